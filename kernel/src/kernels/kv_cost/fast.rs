//! The inner loops of [`kv_cost`](super::kv_cost) (the cost column) and of
//! the fused KV cost + argmin for the common cost shapes, compiled once per
//! shape with no branch per lane group on a configuration flag, an optional
//! column or a column's encoding, and no bounds check per group (every
//! column is cut to whole mask words once).
//!
//! A shape is what [`cost_lanes`](super::cost_lanes) would branch on per
//! group, resolved once per call: the formula (prefill blocks tracked
//! without decay, or the decode formula), whether active requests are
//! weighted, and how the load columns are stored (plain `u32`s, or the
//! fleet's tagged counters: one shift and one signed conversion, exact
//! because a shifted counter is below `2^31`). The shape takes the device
//! overlap column and, for the prefill formula, the cached tokens; any other
//! optional column, a load-availability mask, the decay or a prefill pool
//! without tracking take the general loops (`kv_cost_in`, `fused`); so do
//! the lane groups past the last whole mask word.
//!
//! [`fast_cost_lanes`] performs [`cost_lanes`](super::cost_lanes)'
//! operations for its shape in the same order, so the costs are the same
//! bits (the differential tests run both shapes and the general loop
//! against the scalar reference). `max(x, 0)` with NaN mapped to 0 is one
//! `max` with `x` first, as [`F32Lanes::max`] returns its second operand
//! when either is NaN.
//!
//! This module must not pick or book: it computes costs and hands each
//! lane group to the running minimum of `fused` or to the output column.

use super::fused::{TieRun, Ties};
use super::{KvLoad, KvOverlap, Prepared};
use crate::lanes::{CounterValues, GroupValues, PlainValues, U32Source, Words, LANES};
use crate::simd::{F32Lanes, Simd, U32Lanes};

/// The columns and per-request constants of one call in a fast shape.
pub(super) struct Plan<'a> {
    prefill: Words<'a>,
    decode: Words<'a>,
    requests: Words<'a>,
    device: &'a [[[f32; LANES]; 8]],
    /// Empty for the decode formula (not read).
    cached: &'a [[[f32; LANES]; 8]],
    decode_formula: bool,
    req_on: bool,
    credit: f32,
    isl: f32,
    bs: f32,
    scale: f32,
    added: f32,
    req_w: f32,
}

/// The columns of a call, the load columns read by `W`, all of the same
/// length in mask words.
#[derive(Clone, Copy)]
struct Cols<'a, W> {
    prefill: W,
    decode: W,
    requests: W,
    device: &'a [[[f32; LANES]; 8]],
    cached: &'a [[[f32; LANES]; 8]],
}

impl<'a> Plan<'a> {
    /// The plan for the lane groups of the first `words` mask words
    /// (`8 * words` full lane groups), or `None` when the call is not in a
    /// fast shape.
    #[inline(always)]
    pub(super) fn new<L: U32Source + ?Sized>(
        p: &Prepared,
        load: &KvLoad<'a, L>,
        overlap: &KvOverlap<'a>,
        words: usize,
    ) -> Option<Plan<'a>> {
        let others_absent = overlap.host_blocks.is_none()
            && overlap.disk_blocks.is_none()
            && overlap.shared_beyond_device.is_none()
            && overlap.added_decode_blocks.is_none()
            && overlap.preferred_taint_multiplier.is_none()
            && load.load_available.is_none();
        if !others_absent || p.decay_on || !(p.decode_formula || p.track) {
            return None;
        }
        let chunks = |c: &'a [f32]| c.as_chunks::<LANES>().0.as_chunks::<8>().0.get(..words);
        let device = chunks(overlap.device_blocks?)?;
        let cached = if p.decode_formula {
            &[][..]
        } else {
            chunks(overlap.cached_tokens?)?
        };
        Some(Plan {
            prefill: load.active_prefill_tokens.group_words(words)?.0,
            decode: load.active_decode_blocks.group_words(words)?.0,
            requests: load.active_requests.group_words(words)?.0,
            device,
            cached,
            decode_formula: p.decode_formula,
            req_on: p.req_on,
            credit: p.credit,
            isl: p.isl,
            bs: p.bs,
            scale: p.scale,
            added: p.added as f32,
            req_w: p.req_w,
        })
    }

    /// Folds the costs of the plan's lane groups into `ties` and `hi`, as
    /// `fused`'s general loop does.
    #[inline(always)]
    pub(super) fn scan<S: Simd>(&self, s: S, mask: &[u64], ties: &mut Ties, hi: &mut S::F32) {
        let mut job: Job<'_, S> = Job::Argmin { ties, hi };
        self.run(s, mask, &mut job);
    }

    /// Writes the costs of the plan's lane groups into `out` (`+inf` on
    /// ineligible rows) and folds them into the lane-wise range `lo`, `hi`,
    /// as `kv_cost`'s general loop does. `out` holds at least the plan's rows.
    #[inline(always)]
    pub(super) fn write<S: Simd>(&self, s: S, mask: &[u64], out: &mut [f32], lo: &mut S::F32, hi: &mut S::F32) {
        let n = self.device.len();
        let out = &mut out.as_chunks_mut::<LANES>().0.as_chunks_mut::<8>().0[..n];
        let mut job: Job<'_, S> = Job::Column { out, lo, hi };
        self.run(s, mask, &mut job);
    }

    /// Runs `job` in the loop compiled for the plan's column form and shape.
    #[inline(always)]
    fn run<S: Simd>(&self, s: S, mask: &[u64], job: &mut Job<'_, S>) {
        // Every column sliced to the same length: one bound for the loop and
        // no check per group.
        let n = self.device.len();
        let cached = &self.cached[..if self.decode_formula { 0 } else { n }];
        match (self.prefill, self.decode, self.requests) {
            (Words::Plain(p), Words::Plain(d), Words::Plain(r)) => {
                let cols = Cols {
                    prefill: PlainValues(&p[..n]),
                    decode: PlainValues(&d[..n]),
                    requests: PlainValues(&r[..n]),
                    device: self.device,
                    cached,
                };
                self.run_shape(s, cols, mask, job);
            }
            (Words::Counter(p, ps), Words::Counter(d, ds), Words::Counter(r, rs)) => {
                let cols = Cols {
                    prefill: CounterValues(&p[..n], ps),
                    decode: CounterValues(&d[..n], ds),
                    requests: CounterValues(&r[..n], rs),
                    device: self.device,
                    cached,
                };
                self.run_shape(s, cols, mask, job);
            }
            _ => unreachable!("the load columns of one call share their type"),
        }
    }

    /// [`run`](Self::run) for one column form: picks the formula's loop.
    #[inline(always)]
    fn run_shape<S: Simd, W: GroupValues>(&self, s: S, cols: Cols<'_, W>, mask: &[u64], job: &mut Job<'_, S>) {
        match (self.decode_formula, self.req_on) {
            (false, false) => job.run::<W, false, false>(s, self, cols, mask),
            (false, true) => job.run::<W, false, true>(s, self, cols, mask),
            (true, false) => job.run::<W, true, false>(s, self, cols, mask),
            (true, true) => job.run::<W, true, true>(s, self, cols, mask),
        }
    }
}

/// What a fast loop does with the costs.
enum Job<'j, S: Simd> {
    /// The fused argmin's running minimum and maximum.
    Argmin { ties: &'j mut Ties, hi: &'j mut S::F32 },
    /// `kv_cost`'s output column and lane-wise range.
    Column {
        out: &'j mut [[[f32; LANES]; 8]],
        lo: &'j mut S::F32,
        hi: &'j mut S::F32,
    },
}

impl<S: Simd> Job<'_, S> {
    #[inline(always)]
    fn run<W: GroupValues, const DECODE: bool, const REQ: bool>(
        &mut self,
        s: S,
        plan: &Plan<'_>,
        cols: Cols<'_, W>,
        mask: &[u64],
    ) {
        match self {
            Job::Argmin { ties, hi } => scan_loop::<S, W, DECODE, REQ>(s, plan, cols, mask, ties, hi),
            Job::Column { out, lo, hi } => column_loop::<S, W, DECODE, REQ>(s, plan, cols, mask, out, lo, hi),
        }
    }
}

/// The per-request constants as lanes.
#[derive(Clone, Copy)]
struct Consts<F> {
    credit: F,
    isl: F,
    bs: F,
    scale: F,
    added: F,
    req_w: F,
    zero: F,
}

impl<F> Consts<F> {
    #[inline(always)]
    fn new<S: Simd<F32 = F>>(s: S, plan: &Plan<'_>) -> Self {
        Consts {
            credit: s.splat_f32(plan.credit),
            isl: s.splat_f32(plan.isl),
            bs: s.splat_f32(plan.bs),
            scale: s.splat_f32(plan.scale),
            added: s.splat_f32(plan.added),
            req_w: s.splat_f32(plan.req_w),
            zero: s.splat_f32(0.0),
        }
    }
}

/// The costs of group `i` of mask word `w` in shape (`DECODE`, `REQ`): the
/// operations of [`cost_lanes`](super::cost_lanes) for that shape, in its
/// order.
#[inline(always)]
fn fast_cost_lanes<S: Simd, W: GroupValues, const DECODE: bool, const REQ: bool>(
    s: S,
    k: &Consts<S::F32>,
    cols: &Cols<'_, W>,
    w: usize,
    i: usize,
) -> S::F32 {
    let decode_cost = cols.decode.values_f32(s, w, i) + k.added;
    let credit = k.credit * s.load_f32(&cols.device[w][i]);
    let cost = if DECODE {
        (decode_cost - credit).max(k.zero)
    } else {
        let cached = s.load_f32(&cols.cached[w][i]);
        let with_load = (cols.prefill.values_f32(s, w, i) + cached.max(k.isl)) / k.bs;
        k.scale * (with_load - credit).max(k.zero) + decode_cost
    };
    if REQ {
        cost + k.req_w * cols.requests.values_f32(s, w, i)
    } else {
        cost
    }
}

/// The loop of one shape: the search for the next group that may hold the
/// minimum ([`next_candidate`]), then the running minimum's fold, inlined
/// (a call would clobber every vector register of the loop).
#[inline(always)]
fn scan_loop<S: Simd, W: GroupValues, const DECODE: bool, const REQ: bool>(
    s: S,
    plan: &Plan<'_>,
    cols: Cols<'_, W>,
    mask: &[u64],
    ties: &mut Ties,
    hi: &mut S::F32,
) {
    let mut g = 0;
    let mut folds = 0;
    while let Some((at, c, bits)) = next_candidate::<S, W, DECODE, REQ>(s, plan, &cols, mask, g, ties.best, hi) {
        ties.fold_lanes(s, at, c, bits);
        g = at + 1;
        folds += 1;
        if folds == FOLDS_BEFORE_TIE_LOOP {
            tie_loop::<S, W, DECODE, REQ>(s, plan, &cols, mask, g, ties, hi);
            return;
        }
    }
}

/// Groups folded by [`scan_loop`]'s search before it hands the rest of the
/// scan to [`tie_loop`]: a fleet where this many groups hold the running
/// minimum or tie with it (idle workers, nothing cached: every group ties)
/// is cheaper to scan with the fold in the loop than by leaving and
/// re-entering the search at every group.
const FOLDS_BEFORE_TIE_LOOP: usize = 8;

/// The rest of [`scan_loop`]'s scan from lane group `g` on, with the fold
/// inside the loop: every group's costs folded into `hi` (as
/// [`next_candidate`] does) and, where an eligible lane is `<= best`, into
/// the running minimum and its ties.
#[inline(always)]
fn tie_loop<S: Simd, W: GroupValues, const DECODE: bool, const REQ: bool>(
    s: S,
    plan: &Plan<'_>,
    cols: &Cols<'_, W>,
    mask: &[u64],
    g: usize,
    ties: &mut Ties,
    hi: &mut S::F32,
) {
    let k = Consts::new(s, plan);
    let mut run = TieRun::new(ties);
    let mut best = s.splat_f32(run.best);
    let mut acc = *hi;
    for w in g / 8..cols.device.len() {
        let word = mask.get(w).copied().unwrap_or(0);
        let from = if w == g / 8 { g % 8 } else { 0 };
        if word == u64::MAX && from == 0 {
            for i in 0..8 {
                let c = fast_cost_lanes::<S, W, DECODE, REQ>(s, &k, cols, w, i);
                acc = c.max(acc);
                let le = c.cmp_le(best).bits();
                if le != 0 && run.fold_le(s, w * 8 + i, c, best, le, 0xFF) {
                    best = s.splat_f32(run.best);
                }
            }
        } else if word != 0 {
            for i in from..8 {
                let bits = (word >> (i * 8)) as u8;
                if bits == 0 {
                    continue;
                }
                let c = fast_cost_lanes::<S, W, DECODE, REQ>(s, &k, cols, w, i);
                acc = c.max(acc);
                let le = c.cmp_le(best).bits() & bits;
                if le != 0 && run.fold_le(s, w * 8 + i, c, best, le, bits) {
                    best = s.splat_f32(run.best);
                }
            }
        }
    }
    run.finish();
    *hi = acc;
}

/// From lane group `g` on, the first group with an eligible cost `<= best`
/// (its index, its costs, and its eligible lanes: the fold reads only
/// those), folding every cost of each group that has an eligible row into
/// `hi` (`max`, NaN ignored) on the way. `hi` may therefore also hold an
/// ineligible row's cost of that group: it only decides whether the
/// finiteness check runs, and that check reads eligible rows only. Whole
/// mask words of eligible rows take no mask work, all-zero words are
/// skipped, and a partly eligible group costs one scalar `and`.
#[inline(always)]
fn next_candidate<S: Simd, W: GroupValues, const DECODE: bool, const REQ: bool>(
    s: S,
    plan: &Plan<'_>,
    cols: &Cols<'_, W>,
    mask: &[u64],
    g: usize,
    best: f32,
    hi: &mut S::F32,
) -> Option<(usize, S::F32, u8)> {
    let k = Consts::new(s, plan);
    let best = s.splat_f32(best);
    let words = cols.device.len();
    let mut acc = *hi;
    let mut found = None;
    let (mut w, mut from) = (g / 8, g % 8);
    'words: while w < words {
        let word = mask.get(w).copied().unwrap_or(0);
        if word == u64::MAX && from == 0 {
            for i in 0..8 {
                let c = fast_cost_lanes::<S, W, DECODE, REQ>(s, &k, cols, w, i);
                acc = c.max(acc);
                if c.cmp_le(best).bits() != 0 {
                    found = Some((w * 8 + i, c, 0xFF));
                    break 'words;
                }
            }
        } else if word != 0 {
            for i in from..8 {
                let bits = (word >> (i * 8)) as u8;
                if bits == 0 {
                    continue;
                }
                // No lane mask: `hi` takes every lane of a group with an
                // eligible row (see above), and the candidate test keeps
                // only the eligible lanes' bits.
                let c = fast_cost_lanes::<S, W, DECODE, REQ>(s, &k, cols, w, i);
                acc = c.max(acc);
                if c.cmp_le(best).bits() & bits != 0 {
                    found = Some((w * 8 + i, c, bits));
                    break 'words;
                }
            }
        }
        w += 1;
        from = 0;
    }
    *hi = acc;
    found
}

/// `kv_cost`'s loop in one shape: each lane group's costs (`+inf` on
/// ineligible rows) stored and folded into the lane-wise `lo` (`<`) and
/// `hi` (`>`, eligible lanes only), as its general loop does.
#[inline(always)]
fn column_loop<S: Simd, W: GroupValues, const DECODE: bool, const REQ: bool>(
    s: S,
    plan: &Plan<'_>,
    cols: Cols<'_, W>,
    mask: &[u64],
    out: &mut [[[f32; LANES]; 8]],
    lo: &mut S::F32,
    hi: &mut S::F32,
) {
    let k = Consts::new(s, plan);
    let inf = s.splat_f32(f32::INFINITY);
    let (mut l, mut h) = (*lo, *hi);
    let words = cols.device.len().min(out.len());
    for (w, dst) in out[..words].iter_mut().enumerate() {
        let word = mask.get(w).copied().unwrap_or(0);
        if word == u64::MAX {
            for (i, dst) in dst.iter_mut().enumerate() {
                let c = fast_cost_lanes::<S, W, DECODE, REQ>(s, &k, &cols, w, i);
                l = c.cmp_lt(l).blend(c, l);
                h = c.cmp_gt(h).blend(c, h);
                *dst = c.to_array();
            }
        } else {
            for (i, dst) in dst.iter_mut().enumerate() {
                let bits = (word >> (i * 8)) as u8;
                if bits == 0 {
                    *dst = [f32::INFINITY; LANES];
                    continue;
                }
                let on = s.lane_mask(bits).cast_f32();
                let c = on.blend(fast_cost_lanes::<S, W, DECODE, REQ>(s, &k, &cols, w, i), inf);
                l = c.cmp_lt(l).blend(c, l);
                h = (on & c.cmp_gt(h)).blend(c, h);
                *dst = c.to_array();
            }
        }
    }
    (*lo, *hi) = (l, h);
}
