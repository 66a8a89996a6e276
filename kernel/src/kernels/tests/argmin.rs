//! The argmin's tie regimes (dense, moderate, counted; see
//! `kernels::argmin`): columns built to take each one, on every backend and
//! column form (plain `u32`, fleet counters with tags, `f32` costs), against
//! the reference row and draws, and uniform over the ties.

use super::{chi2_999, chi_square};
use crate::kernels::argmin::{tie_regime, TieRegime};
use crate::kernels::least_loaded::{least_loaded_on, least_loaded_reference};
use crate::kernels::pick::{pick_min_on, pick_min_reference};
use crate::lanes::{Column, Decode};
use crate::simd::Backend;
use crate::sync::Ordering;
use crate::Rng;
use std::vec;
use std::vec::Vec;

/// Lane groups of the counter columns (1,280 rows).
const GROUPS: usize = 160;

/// One column shape: its rows, the eligible rows and the rows at the
/// minimum; its name starts with the regime that must follow from them.
struct Case {
    name: &'static str,
    rows: usize,
    mask: Vec<u64>,
    ties: Vec<usize>,
}

impl Case {
    /// Loads: 1 on the ties, 2 to 4 elsewhere (and 0 on rows that are not
    /// eligible, which must not win).
    fn loads(&self) -> Vec<u32> {
        (0..self.rows)
            .map(|r| {
                if self.ties.contains(&r) {
                    1
                } else if crate::mask::contains(&self.mask, r) {
                    2 + (r % 3) as u32
                } else {
                    0
                }
            })
            .collect()
    }
}

fn full_mask(rows: usize) -> Vec<u64> {
    vec![u64::MAX; rows.div_ceil(64)]
}

fn cases() -> Vec<Case> {
    // Two ties in one cell: word 3, lane 2, groups 1 and 5.
    let moderate: Vec<usize> = vec![5, 69, 64 * 3 + 8 + 2, 64 * 3 + 40 + 2, 200, 333, 500, 640, 999, 1001];
    // A partly eligible mask: every other row of the odd words.
    let mut patchy = full_mask(1000);
    for w in patchy.iter_mut().skip(1).step_by(2) {
        *w = 0x5555_5555_5555_5555;
    }
    vec![
        Case {
            name: "dense: a third of the rows",
            rows: 1000,
            mask: full_mask(1000),
            ties: (0..1000).step_by(3).collect(),
        },
        Case {
            name: "dense, partly eligible",
            rows: 1000,
            ties: (0..1000)
                .step_by(5)
                .filter(|&r| crate::mask::contains(&patchy, r))
                .collect(),
            mask: patchy,
        },
        Case {
            name: "moderate, with a cell of two and a tail tie",
            rows: 1003,
            mask: full_mask(1003),
            ties: moderate,
        },
        Case {
            name: "moderate, tied cells past the 8-bit group count",
            rows: GROUPS * 8,
            mask: full_mask(GROUPS * 8),
            ties: (0..14).map(|i| 90 * i + 7).collect(),
        },
        Case {
            name: "counted: two cells",
            rows: 1000,
            mask: full_mask(1000),
            ties: vec![10, 900],
        },
        Case {
            name: "counted: one tie",
            rows: 1000,
            mask: full_mask(1000),
            ties: vec![77],
        },
        Case {
            name: "counted: ties past the last whole lane group only",
            rows: 1005,
            mask: full_mask(1005),
            ties: vec![1001, 1004],
        },
    ]
}

/// The regime each case was built for.
fn expected(case: &Case) -> TieRegime {
    match case
        .name
        .split(':')
        .next()
        .unwrap_or("")
        .split(',')
        .next()
        .unwrap_or("")
    {
        "dense" => TieRegime::Dense,
        n if n.starts_with("moderate") => {
            let grouped = case.rows / 8 * 8;
            let tail = case.ties.iter().filter(|&&r| r >= grouped).count();
            let mut cells: Vec<(usize, usize)> = case
                .ties
                .iter()
                .filter(|&&r| r < grouped)
                .map(|&r| (r / 64, r % 8))
                .collect();
            cells.sort_unstable();
            cells.dedup();
            TieRegime::Moderate {
                cells: cells.len(),
                tail,
            }
        }
        _ => TieRegime::Counted,
    }
}

#[test]
fn every_tie_regime_matches_the_reference_on_every_column_form() {
    for case in cases() {
        let loads = case.loads();
        let regime = tie_regime(case.rows, &case.mask, u32::MAX, 2, &|r| loads[r], 1);
        assert_eq!(regime, expected(&case), "{}", case.name);
        let costs: Vec<f32> = loads.iter().map(|&l| l as f32 * 0.5).collect();
        let column = Column::<GROUPS>::new(0);
        let mut tags = Rng::new(7);
        for (row, &l) in loads.iter().enumerate() {
            column
                .at(row)
                .store(l << 8 | (tags.next_u64() as u32 & 0xFF), Ordering::Relaxed);
        }
        let counters = column.view(case.rows, Decode::Shift(8));
        for seed in 0..60u64 {
            for backend in Backend::available() {
                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let row = least_loaded_on(backend, &loads[..], &case.mask, &mut a);
                assert_eq!(
                    row,
                    least_loaded_reference(&loads[..], &case.mask, &mut b),
                    "{}",
                    case.name
                );
                assert_eq!(a, b, "{} seed {seed}: draws", case.name);
                assert!(row.is_some_and(|r| case.ties.contains(&r)), "{}: {row:?}", case.name);

                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let row = least_loaded_on(backend, &counters, &case.mask, &mut a);
                assert_eq!(
                    row,
                    least_loaded_reference(&counters, &case.mask, &mut b),
                    "{} counters",
                    case.name
                );
                assert_eq!(a, b, "{} counters seed {seed}: draws", case.name);

                let (mut a, mut b) = (Rng::new(seed), Rng::new(seed));
                let row = pick_min_on(backend, &costs[..], &case.mask, &mut a);
                assert_eq!(
                    row,
                    pick_min_reference(&costs[..], &case.mask, &mut b),
                    "{} costs",
                    case.name
                );
                assert_eq!(a, b, "{} costs seed {seed}: draws", case.name);
            }
        }
    }
}

#[test]
fn every_tie_regime_is_uniform() {
    for case in cases() {
        let loads = case.loads();
        let draws = 250 * case.ties.len() as u64;
        for backend in Backend::available() {
            let mut rng = Rng::new(11);
            let mut counts = vec![0u64; case.ties.len()];
            for _ in 0..draws {
                let row = least_loaded_on(backend, &loads[..], &case.mask, &mut rng).expect("a row");
                let i = case.ties.iter().position(|&t| t == row).expect("a tie");
                counts[i] += 1;
            }
            if case.ties.len() > 1 {
                let p = vec![1.0 / case.ties.len() as f64; case.ties.len()];
                let x2 = chi_square(&counts, &p);
                let bound = chi2_999(case.ties.len() - 1);
                assert!(
                    x2 < bound,
                    "{backend:?} {}: chi2 {x2} >= {bound}: {counts:?}",
                    case.name
                );
            }
        }
    }
}
