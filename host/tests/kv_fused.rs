//! The KV policy at temperature 0 takes the kernel's one-pass cost and
//! argmin when no explanation is asked for, and the cost column plus the
//! pick otherwise: both must land on the least cost `costs()` reports, on
//! fleets with varied load and overlaps on about 60% of the ranks.

use selkie::*;

/// A small deterministic generator for the fleets.
struct Draw(u64);

impl Draw {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn one_pass_and_cost_column_choose_the_least_cost() {
    let mut draw = Draw(0x5EED_1234_9876_ABCD);
    for fleet in 0..24u64 {
        let s = WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig {
                seed: Some(fleet),
                ..ServiceConfig::default()
            },
        );
        let workers = 1 + draw.below(300);
        for id in 0..workers {
            s.add_worker(WorkerRecord::new(id + 1).with_dp(0, 1 + draw.below(3) as u32))
                .unwrap();
        }
        let ranks: Vec<WorkerWithDpRank> = s
            .workers()
            .iter()
            .flat_map(|r| {
                (r.data_parallel_start_rank..r.data_parallel_start_rank + r.data_parallel_size)
                    .map(move |k| WorkerWithDpRank::new(r.worker_id, k))
            })
            .collect();
        // Varied load: bookings of varied prompt lengths held on random ranks.
        let mut held = Vec::new();
        for _ in 0..draw.below(2 * ranks.len() as u64 + 1) {
            let rank = ranks[draw.below(ranks.len() as u64) as usize];
            let req = SelectionRequest::new(1 + draw.below(4_000) as usize).pinned_to_rank(rank);
            held.push(s.select(&req).unwrap());
        }
        for _ in 0..8 {
            let mut overlaps = Vec::new();
            for &w in &ranks {
                if draw.below(10) < 6 {
                    overlaps.push(WorkerOverlap::device(w, draw.below(200) as u32, 16));
                }
            }
            let isl = 16 + draw.below(8_000) as usize;
            let req = SelectionRequest::new(isl)
                .with_overlaps(&overlaps)
                .with_temperature(0.0);
            let costs = s.costs(&req).unwrap();
            let least = costs.iter().map(|&(_, c)| c).fold(f64::INFINITY, f64::min);
            let cost_of = |w: WorkerWithDpRank| costs.iter().find(|&&(r, _)| r == w).unwrap().1;
            let one_pass = s.select(&req).unwrap();
            assert_eq!(cost_of(one_pass.worker()), least, "fleet {fleet}: one pass");
            assert_eq!(one_pass.explanation().cost, least, "fleet {fleet}: reported cost");
            drop(one_pass);
            let column = s.select(&req.explained()).unwrap();
            assert_eq!(cost_of(column.worker()), least, "fleet {fleet}: cost column");
        }
        drop(held);
    }
}
