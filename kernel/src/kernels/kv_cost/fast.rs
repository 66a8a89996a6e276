//! The inner loops of [`kv_cost`](super::kv_cost) (the cost column) and of
//! the fused KV cost + argmin for the common cost shapes, compiled once per
//! shape with no branch per lane group on a configuration flag, an optional
//! column or a column's encoding, and no bounds check per group (every
//! column is cut to whole mask words once).
//!
//! A shape is what [`cost_lanes`](super::cost_lanes) would branch on per
//! group, resolved once per call: the formula (prefill blocks tracked
//! without decay, or the decode formula), whether active requests are
//! weighted, whether the prefill term's scale is 1 (its multiply left out:
//! `1 * x` is `x`), and how the load columns are stored (plain `u32`s, or the
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
//! mask word's least costs to the argmin of `fused` or each lane group to
//! the output column.

use super::{KvLoad, KvOverlap, Prepared};
use crate::kernels::argmin::Least;
use crate::lanes::{CounterValues, GroupValues, PlainValues, U32Source, Words, LANES};
use crate::simd::{F32Lanes, Simd, U32Lanes};

/// `body` once for each lane group of a word, with `$g` the group as a
/// constant [`At`].
macro_rules! for_each_group {
    ($g:ident => $body:expr) => {{
        {
            let $g = At::<0>;
            $body
        }
        {
            let $g = At::<1>;
            $body
        }
        {
            let $g = At::<2>;
            $body
        }
        {
            let $g = At::<3>;
            $body
        }
        {
            let $g = At::<4>;
            $body
        }
        {
            let $g = At::<5>;
            $body
        }
        {
            let $g = At::<6>;
            $body
        }
        {
            let $g = At::<7>;
            $body
        }
    }};
}

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
    #[cfg_attr(not(debug_assertions), inline(always))]
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

    /// Pushes each of the plan's mask words' lane-wise least eligible cost
    /// into `least` and folds the costs into `hi`, as `fused`'s general
    /// loop does.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(super) fn least<S: Simd>(&self, s: S, mask: &[u64], least: &mut Least<'_, S, f32>, hi: &mut S::F32) {
        let mut job: Job<'_, '_, S> = Job::Argmin { least, hi };
        self.run(s, mask, &mut job);
    }

    /// Writes the costs of the plan's lane groups into `out` (`+inf` on
    /// ineligible rows) and folds them into the lane-wise range `lo`, `hi`,
    /// as `kv_cost`'s general loop does. `out` holds at least the plan's rows.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(super) fn write<S: Simd>(&self, s: S, mask: &[u64], out: &mut [f32], lo: &mut S::F32, hi: &mut S::F32) {
        let n = self.device.len();
        let out = &mut out.as_chunks_mut::<LANES>().0.as_chunks_mut::<8>().0[..n];
        let mut job: Job<'_, '_, S> = Job::Column { out, lo, hi };
        self.run(s, mask, &mut job);
    }

    /// The costs of the eight lane groups of the plan's mask word `w`, as
    /// the loops compute them (the argmin's second read of a word holding
    /// a tie).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(super) fn word_costs<S: Simd>(&self, s: S, w: usize) -> [S::F32; 8] {
        let mut out = [s.splat_f32(0.0); 8];
        let mut job: Job<'_, '_, S> = Job::Word { w, out: &mut out };
        self.run(s, &[], &mut job);
        out
    }

    /// The costs of lane group `g` of the plan's mask words, as the loops
    /// compute them (a single try of the argmin's rejection step).
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(super) fn group_costs<S: Simd>(&self, s: S, g: usize) -> S::F32 {
        let mut out = [s.splat_f32(0.0); 8];
        let mut job: Job<'_, '_, S> = Job::Group { g, out: &mut out[0] };
        self.run(s, &[], &mut job);
        out[0]
    }

    /// The number of mask words the plan covers.
    #[cfg_attr(not(debug_assertions), inline(always))]
    pub(super) fn words(&self) -> usize {
        self.device.len()
    }

    /// Runs `job` in the loop compiled for the plan's column form and shape.
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn run<S: Simd>(&self, s: S, mask: &[u64], job: &mut Job<'_, '_, S>) {
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
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn run_shape<S: Simd, W: GroupValues>(&self, s: S, cols: Cols<'_, W>, mask: &[u64], job: &mut Job<'_, '_, S>) {
        let bit = |on: bool, bit: u8| if on { bit } else { 0 };
        let shape = bit(self.decode_formula, DECODE) | bit(self.req_on, REQ) | bit(self.scale == 1.0, UNSCALED);
        if S::INLINE_SHAPES {
            match shape {
                0 => job.run::<W, 0>(s, self, cols, mask),
                1 => job.run::<W, 1>(s, self, cols, mask),
                2 => job.run::<W, 2>(s, self, cols, mask),
                3 => job.run::<W, 3>(s, self, cols, mask),
                4 => job.run::<W, 4>(s, self, cols, mask),
                5 => job.run::<W, 5>(s, self, cols, mask),
                6 => job.run::<W, 6>(s, self, cols, mask),
                _ => job.run::<W, 7>(s, self, cols, mask),
            }
        } else {
            match shape {
                0 => out_of_line(|| job.run::<W, 0>(s, self, cols, mask)),
                1 => out_of_line(|| job.run::<W, 1>(s, self, cols, mask)),
                2 => out_of_line(|| job.run::<W, 2>(s, self, cols, mask)),
                3 => out_of_line(|| job.run::<W, 3>(s, self, cols, mask)),
                4 => out_of_line(|| job.run::<W, 4>(s, self, cols, mask)),
                5 => out_of_line(|| job.run::<W, 5>(s, self, cols, mask)),
                6 => out_of_line(|| job.run::<W, 6>(s, self, cols, mask)),
                _ => out_of_line(|| job.run::<W, 7>(s, self, cols, mask)),
            }
        }
    }
}

/// One shape's loop as a function of its own (backends without
/// [`Simd::INLINE_SHAPES`]).
#[inline(never)]
fn out_of_line(run: impl FnOnce()) {
    run()
}

/// What a fast loop does with the costs.
enum Job<'j, 'r, S: Simd> {
    /// The fused argmin's pass-1 state and maximum.
    Argmin {
        least: &'j mut Least<'r, S, f32>,
        hi: &'j mut S::F32,
    },
    /// One mask word's eight lane groups' costs.
    Word { w: usize, out: &'j mut [S::F32; 8] },
    /// One lane group's costs.
    Group { g: usize, out: &'j mut S::F32 },
    /// `kv_cost`'s output column and lane-wise range.
    Column {
        out: &'j mut [[[f32; LANES]; 8]],
        lo: &'j mut S::F32,
        hi: &'j mut S::F32,
    },
}

impl<S: Simd> Job<'_, '_, S> {
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn run<W: GroupValues, const SHAPE: u8>(&mut self, s: S, plan: &Plan<'_>, cols: Cols<'_, W>, mask: &[u64]) {
        match self {
            Job::Argmin { least, hi } => least_loop::<S, W, SHAPE>(s, plan, cols, mask, least, hi),
            Job::Group { g, out } => {
                let k = Consts::new(s, plan);
                **out = fast_cost_lanes::<S, W, SHAPE, _>(s, &k, &cols, *g / 8, Dyn(*g % 8));
            }
            Job::Word { w, out } => {
                let k = Consts::new(s, plan);
                let w = *w;
                for_each_group!(g => {
                    out[g.index()] = fast_cost_lanes::<S, W, SHAPE, _>(s, &k, &cols, w, g);
                });
            }
            Job::Column { out, lo, hi } => column_loop::<S, W, SHAPE>(s, plan, cols, mask, out, lo, hi),
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
    #[cfg_attr(not(debug_assertions), inline(always))]
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

/// A lane group's index within its mask word: a constant ([`At`], for the
/// unrolled loop over a whole word, whose atomic loads then need no address
/// arithmetic) or a run-time one ([`Dyn`]).
trait Group: Copy {
    /// The index (`< 8`).
    fn index(self) -> usize;
    /// This group of word `w` of `col`, as `f32` lanes.
    fn values<S: Simd, W: GroupValues>(self, s: S, col: W, w: usize) -> S::F32;
}

/// Group `I` of a word.
#[derive(Clone, Copy)]
struct At<const I: usize>;

impl<const I: usize> Group for At<I> {
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn index(self) -> usize {
        I
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn values<S: Simd, W: GroupValues>(self, s: S, col: W, w: usize) -> S::F32 {
        col.values_f32_at::<S, I>(s, w)
    }
}

/// A group chosen at run time.
#[derive(Clone, Copy)]
struct Dyn(usize);

impl Group for Dyn {
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn index(self) -> usize {
        self.0
    }
    #[cfg_attr(not(debug_assertions), inline(always))]
    fn values<S: Simd, W: GroupValues>(self, s: S, col: W, w: usize) -> S::F32 {
        col.values_f32(s, w, self.0)
    }
}

/// Bits of a loop's shape: the decode formula (else the prefill one).
const DECODE: u8 = 1;
/// Bits of a loop's shape: active requests weighted.
const REQ: u8 = 2;
/// Bits of a loop's shape: the prefill term's scale is 1.
const UNSCALED: u8 = 4;

/// The costs of group `g` of mask word `w` in shape `SHAPE` (the bits
/// [`DECODE`], [`REQ`], [`UNSCALED`]): the
/// operations of [`cost_lanes`](super::cost_lanes) for that shape, in its
/// order.
#[cfg_attr(not(debug_assertions), inline(always))]
fn fast_cost_lanes<S: Simd, W: GroupValues, const SHAPE: u8, G: Group>(
    s: S,
    k: &Consts<S::F32>,
    cols: &Cols<'_, W>,
    w: usize,
    g: G,
) -> S::F32 {
    let i = g.index();
    let decode_cost = g.values(s, cols.decode, w) + k.added;
    let credit = k.credit * s.load_f32(&cols.device[w][i]);
    let cost = if SHAPE & DECODE != 0 {
        (decode_cost - credit).max(k.zero)
    } else {
        let cached = s.load_f32(&cols.cached[w][i]);
        let with_load = (g.values(s, cols.prefill, w) + cached.max(k.isl)) / k.bs;
        let prefill = (with_load - credit).max(k.zero);
        // `1 * x` is `x`, bit for bit (NaN payloads aside, which no test
        // promises): the multiply is left out at the default scale.
        if SHAPE & UNSCALED != 0 {
            prefill + decode_cost
        } else {
            k.scale * prefill + decode_cost
        }
    };
    if SHAPE & REQ != 0 {
        cost + k.req_w * g.values(s, cols.requests, w)
    } else {
        cost
    }
}

/// The fused argmin's loop in one shape: each mask word's lane-wise least
/// eligible cost (ineligible lanes `+inf`, NaN passed over: `min` takes the
/// cost first) pushed into `least`, every cost of a group with an eligible
/// row folded into `hi` (`max`, NaN ignored). `hi` may therefore also hold
/// an ineligible row's cost of such a group: it only decides whether the
/// finiteness check runs, and that check reads eligible rows only. Whole
/// mask words of eligible rows take no mask work.
#[cfg_attr(not(debug_assertions), inline(always))]
fn least_loop<S: Simd, W: GroupValues, const SHAPE: u8>(
    s: S,
    plan: &Plan<'_>,
    cols: Cols<'_, W>,
    mask: &[u64],
    least: &mut Least<'_, S, f32>,
    hi: &mut S::F32,
) {
    let k = Consts::new(s, plan);
    let inf = s.splat_f32(f32::INFINITY);
    let mut acc = *hi;
    for w in 0..cols.device.len() {
        let word = mask.get(w).copied().unwrap_or(0);
        let mut lo = inf;
        if word == u64::MAX {
            for_each_group!(g => {
                let c = fast_cost_lanes::<S, W, SHAPE, _>(s, &k, &cols, w, g);
                acc = c.max(acc);
                lo = c.min(lo);
            });
        } else if word != 0 {
            for i in 0..8 {
                let bits = (word >> (i * 8)) as u8;
                if bits == 0 {
                    continue;
                }
                let c = fast_cost_lanes::<S, W, SHAPE, _>(s, &k, &cols, w, Dyn(i));
                acc = c.max(acc);
                lo = s.lane_mask(bits).cast_f32().blend(c, inf).min(lo);
            }
        }
        // Remembered, not folded: the fold's lanes would not fit in the
        // registers the costs need; the tie cells are counted afterwards.
        least.remember(w, lo);
    }
    *hi = acc;
}

/// `kv_cost`'s loop in one shape: each lane group's costs (`+inf` on
/// ineligible rows) stored and folded into the lane-wise `lo` (`<`) and
/// `hi` (`>`, eligible lanes only), as its general loop does.
#[cfg_attr(not(debug_assertions), inline(always))]
fn column_loop<S: Simd, W: GroupValues, const SHAPE: u8>(
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
            // `min` and `max` return their second operand where either is
            // NaN or they are equal: the same lanes as the blends below.
            for_each_group!(g => {
                let c = fast_cost_lanes::<S, W, SHAPE, _>(s, &k, &cols, w, g);
                l = c.min(l);
                h = c.max(h);
                dst[g.index()] = c.to_array();
            });
        } else {
            for (i, dst) in dst.iter_mut().enumerate() {
                let bits = (word >> (i * 8)) as u8;
                if bits == 0 {
                    *dst = [f32::INFINITY; LANES];
                    continue;
                }
                let on = s.lane_mask(bits).cast_f32();
                let c = on.blend(fast_cost_lanes::<S, W, SHAPE, _>(s, &k, &cols, w, Dyn(i)), inf);
                l = c.cmp_lt(l).blend(c, l);
                h = (on & c.cmp_gt(h)).blend(c, h);
                *dst = c.to_array();
            }
        }
    }
    (*lo, *hi) = (l, h);
}
