//! The plugin API and its contract: declared inputs, filters, scorers,
//! pickers, preview, and every contract violation as a typed error while
//! the service keeps serving.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use selkie::*;

type R<T> = Result<T, WorkerSelectionPolicyError>;

struct ActiveRequests;
impl WorkerScorer for ActiveRequests {
    fn required_worker_inputs(&self) -> WorkerInputs {
        WorkerInputs::LOAD
    }
    fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        for (cost, c) in costs.iter_mut().zip(c.iter()) {
            *cost = c
                .load()
                .ok_or_else(|| WorkerSelectionPolicyError::failed("no LOAD"))?
                .active_requests() as f64;
        }
        Ok(())
    }
}

struct MinCost;
impl WorkerPicker for MinCost {
    fn pick(&self, _: &WorkerSelectionContext<'_>, input: WorkerInputView<'_>) -> R<usize> {
        let c = input.costs();
        (0..c.len())
            .min_by(|&a, &b| c[a].total_cmp(&c[b]))
            .ok_or_else(|| WorkerSelectionPolicyError::failed("empty"))
    }
}

/// A scorer that returns `value` for worker `bad` and 0 elsewhere.
struct Poison {
    bad: u64,
    value: f64,
}
impl WorkerScorer for Poison {
    fn name(&self) -> &'static str {
        "poison"
    }
    fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        for (cost, c) in costs.iter_mut().zip(c.iter()) {
            *cost = if c.worker().worker_id == self.bad {
                self.value
            } else {
                0.0
            };
        }
        Ok(())
    }
}

struct Constant(f64);
impl WorkerScorer for Constant {
    fn score(&self, _: &WorkerSelectionContext<'_>, _: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
        costs.fill(self.0);
        Ok(())
    }
}

/// Writes nothing: the NaN fill stays.
struct Lazy;
impl WorkerScorer for Lazy {
    fn score(&self, _: &WorkerSelectionContext<'_>, _: WorkerCandidates<'_>, _: &mut [f64]) -> R<()> {
        Ok(())
    }
}

struct Fixed(usize);
impl WorkerPicker for Fixed {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn pick(&self, _: &WorkerSelectionContext<'_>, _: WorkerInputView<'_>) -> R<usize> {
        Ok(self.0)
    }
}

struct Panicky;
impl WorkerScorer for Panicky {
    fn name(&self) -> &'static str {
        "panicky"
    }
    fn score(&self, _: &WorkerSelectionContext<'_>, _: WorkerCandidates<'_>, _: &mut [f64]) -> R<()> {
        panic!("scorer exploded")
    }
}

struct PanickyPicker;
impl WorkerPicker for PanickyPicker {
    fn pick(&self, _: &WorkerSelectionContext<'_>, _: WorkerInputView<'_>) -> R<usize> {
        panic!("{}", String::from("picker exploded"))
    }
}

struct KeepOdd;
impl WorkerFilter for KeepOdd {
    fn keep(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidate<'_>) -> R<bool> {
        Ok(c.worker().worker_id % 2 == 1)
    }
}

struct PanickyFilter;
impl WorkerFilter for PanickyFilter {
    fn name(&self) -> &'static str {
        "panicky-filter"
    }
    fn keep(&self, _: &WorkerSelectionContext<'_>, _: WorkerCandidate<'_>) -> R<bool> {
        panic!("filter exploded")
    }
}

fn policy(scorers: Vec<Box<dyn WorkerScorer>>, picker: Box<dyn WorkerPicker>) -> WorkerSelectionPolicy {
    WorkerSelectionPolicy::new(KvRouterConfig::default(), WorkerType::Aggregated, scorers, picker)
}

fn fleet(p: WorkerSelectionPolicy, n: u64) -> WorkerSelectionService {
    let s = WorkerSelectionService::new(
        p,
        ServiceConfig {
            seed: Some(1),
            ..ServiceConfig::default()
        },
    );
    for id in 1..=n {
        s.add_worker(WorkerRecord::new(id)).unwrap();
    }
    s
}

#[test]
fn dynamo_style_policy_spreads_by_active_requests() {
    let s = fleet(policy(vec![Box::new(ActiveRequests)], Box::new(MinCost)), 3);
    let held: Vec<_> = (0..6).map(|_| s.select(&SelectionRequest::new(1)).unwrap()).collect();
    for id in 1..=3 {
        assert_eq!(held.iter().filter(|h| h.worker().worker_id == id).count(), 2);
    }
    assert_eq!(held[0].explanation().branch, Branch::Picker);
}

#[test]
fn each_component_sees_only_its_declared_inputs() {
    struct Probe(Arc<AtomicUsize>);
    impl WorkerScorer for Probe {
        fn required_worker_inputs(&self) -> WorkerInputs {
            WorkerInputs::CACHE
        }
        fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
            for (cost, c) in costs.iter_mut().zip(c.iter()) {
                assert!(c.load().is_none(), "LOAD was not declared by this scorer");
                assert!(c.occupancy().is_none());
                let cache = c.cache().expect("CACHE declared");
                if cache.device_overlap_blocks() > 0.0 {
                    self.0.fetch_add(1, Ordering::Relaxed);
                }
                *cost = -cache.device_overlap_blocks();
            }
            Ok(())
        }
    }
    let seen = Arc::new(AtomicUsize::new(0));
    let p = policy(
        vec![Box::new(ActiveRequests), Box::new(Probe(seen.clone()))],
        Box::new(MinCost),
    );
    assert_eq!(p.required_worker_inputs(), WorkerInputs::LOAD | WorkerInputs::CACHE);
    let s = fleet(p, 2);
    let ov = [WorkerOverlap::device(WorkerWithDpRank::new(2, 0), 3, 16)];
    assert_eq!(
        s.select(&SelectionRequest::new(64).with_overlaps(&ov))
            .unwrap()
            .worker()
            .worker_id,
        2
    );
    assert_eq!(seen.load(Ordering::Relaxed), 1);
}

#[test]
fn non_finite_contributions_and_totals_name_the_scorer_and_row() {
    for value in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let s = fleet(policy(vec![Box::new(Poison { bad: 2, value })], Box::new(MinCost)), 3);
        let e = s.select(&SelectionRequest::new(1)).unwrap_err();
        match e {
            SelectionError::Policy(WorkerSelectionPolicyError::NonFiniteCost {
                scorer_index: 0,
                scorer: "poison",
                row,
            }) => {
                assert!(row < 3)
            }
            other => panic!("{other:?}"),
        }
    }
    // Finite contributions whose running total overflows.
    let s = fleet(
        policy(
            vec![Box::new(Constant(f64::MAX)), Box::new(Constant(f64::MAX))],
            Box::new(MinCost),
        ),
        1,
    );
    assert!(matches!(
        s.select(&SelectionRequest::new(1)),
        Err(SelectionError::Policy(WorkerSelectionPolicyError::NonFiniteCost {
            scorer_index: 1,
            row: 0,
            ..
        }))
    ));
    // A scorer that writes nothing leaves NaN.
    let s = fleet(policy(vec![Box::new(Lazy)], Box::new(MinCost)), 2);
    assert!(matches!(
        s.select(&SelectionRequest::new(1)),
        Err(SelectionError::Policy(WorkerSelectionPolicyError::NonFiniteCost {
            scorer_index: 0,
            ..
        }))
    ));
}

#[test]
fn out_of_range_pick_names_the_row_and_count() {
    let s = fleet(policy(vec![], Box::new(Fixed(7))), 3);
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::Policy(WorkerSelectionPolicyError::InvalidPickerRow {
            row: 7,
            candidate_count: 3
        })
    );
    assert_eq!(
        s.worker_status(1).unwrap().ranks[0].active_requests,
        0,
        "nothing booked"
    );
}

#[test]
fn panicking_plugins_fail_the_request_and_the_service_keeps_serving() {
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {})); // keep the test output quiet
    let s = fleet(policy(vec![Box::new(Panicky)], Box::new(MinCost)), 2);
    for _ in 0..3 {
        match s.select(&SelectionRequest::new(1)).unwrap_err() {
            SelectionError::Policy(WorkerSelectionPolicyError::PluginPanicked { kind, name, message }) => {
                assert_eq!(
                    (kind, name, message.as_str()),
                    (PluginKind::Scorer, "panicky", "scorer exploded")
                );
            }
            other => panic!("{other:?}"),
        }
    }
    let s2 = fleet(policy(vec![], Box::new(PanickyPicker)), 2);
    assert!(matches!(
        s2.select(&SelectionRequest::new(1)),
        Err(SelectionError::Policy(WorkerSelectionPolicyError::PluginPanicked { kind: PluginKind::Picker, ref message, .. }))
            if message == "picker exploded"
    ));
    let s3 = fleet(
        WorkerSelectionPolicy::new_with_filters(
            KvRouterConfig::default(),
            WorkerType::Aggregated,
            vec![Box::new(PanickyFilter)],
            vec![],
            Box::new(MinCost),
        ),
        2,
    );
    assert!(matches!(
        s3.select(&SelectionRequest::new(1)),
        Err(SelectionError::Policy(WorkerSelectionPolicyError::PluginPanicked {
            kind: PluginKind::Filter,
            name: "panicky-filter",
            ..
        }))
    ));
    std::panic::set_hook(prev);
    // The same thread's scratch still works, and a healthy service on it serves.
    let ok = fleet(policy(vec![Box::new(ActiveRequests)], Box::new(MinCost)), 2);
    assert!(ok.select(&SelectionRequest::new(1)).is_ok());
    assert!(
        WorkerSelectionService::new(WorkerSelectionPolicy::random(), ServiceConfig::default())
            .select(&SelectionRequest::new(1))
            .is_err()
    );
}

#[test]
fn policy_filters_narrow_and_can_filter_everything() {
    let with = |filters: Vec<Box<dyn WorkerFilter>>| {
        WorkerSelectionPolicy::new_with_filters(
            KvRouterConfig::default(),
            WorkerType::Aggregated,
            filters,
            vec![Box::new(ActiveRequests)],
            Box::new(MinCost),
        )
    };
    let s = fleet(with(vec![Box::new(KeepOdd)]), 4);
    for _ in 0..10 {
        assert_eq!(s.select(&SelectionRequest::new(1)).unwrap().worker().worker_id % 2, 1);
    }
    let even = fleet(with(vec![Box::new(KeepOdd)]), 0);
    even.add_worker(WorkerRecord::new(2)).unwrap();
    even.add_worker(WorkerRecord::new(4)).unwrap();
    assert_eq!(
        even.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::AllEligibleWorkersFiltered
    );
}

#[test]
fn plugins_can_fail_on_their_own() {
    struct Refuse;
    impl WorkerPicker for Refuse {
        fn pick(&self, _: &WorkerSelectionContext<'_>, _: WorkerInputView<'_>) -> R<usize> {
            Err(WorkerSelectionPolicyError::failed("no thanks"))
        }
    }
    let s = fleet(policy(vec![], Box::new(Refuse)), 1);
    assert_eq!(
        s.select(&SelectionRequest::new(1)).unwrap_err(),
        SelectionError::Policy(WorkerSelectionPolicyError::Failed("no thanks".into()))
    );
}

#[test]
fn context_carries_the_request_and_preview_flag() {
    type Seen = (bool, usize, u64, u32, Option<f64>, Option<String>);
    struct Spy(Arc<std::sync::Mutex<Vec<Seen>>>);
    impl WorkerPicker for Spy {
        fn pick(&self, ctx: &WorkerSelectionContext<'_>, _: WorkerInputView<'_>) -> R<usize> {
            self.0.lock().unwrap().push((
                ctx.is_preview(),
                ctx.prompt_tokens(),
                ctx.request_blocks(),
                ctx.block_size(),
                ctx.router_temperature_override(),
                ctx.lora().map(str::to_owned),
            ));
            Ok(0)
        }
    }
    let log = Arc::new(std::sync::Mutex::new(Vec::new()));
    let s = fleet(policy(vec![], Box::new(Spy(log.clone()))), 1);
    let req = SelectionRequest::new(33).with_temperature(0.5).with_lora("a");
    s.peek(&req).unwrap();
    s.select(&req).unwrap();
    let log = log.lock().unwrap();
    assert_eq!(log[0], (true, 33, 3, 16, Some(0.5), Some("a".into())));
    assert!(!log[1].0);
}

#[test]
fn scorers_sum_and_the_explanation_has_the_runner_up() {
    struct ById;
    impl WorkerScorer for ById {
        fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
            for (cost, c) in costs.iter_mut().zip(c.iter()) {
                *cost = c.worker().worker_id as f64;
            }
            Ok(())
        }
    }
    let s = fleet(
        policy(vec![Box::new(ById), Box::new(Constant(0.5))], Box::new(MinCost)),
        3,
    );
    let p = s.peek(&SelectionRequest::new(1)).unwrap();
    assert_eq!(p.worker.worker_id, 1);
    assert_eq!(p.explanation.cost, 1.5);
    assert_eq!(p.explanation.runner_up, Some((WorkerWithDpRank::new(2, 0), 2.5)));
    assert_eq!(p.explanation.margin(), Some(1.0));
    let text = p.explanation.to_string();
    assert!(
        text.contains("runner-up 2/dp0") && text.contains("margin 1.0000"),
        "{text}"
    );
    let costs = s.costs(&SelectionRequest::new(1)).unwrap();
    assert_eq!(costs.iter().map(|c| c.1).collect::<Vec<_>>(), vec![1.5, 2.5, 3.5]);
}

#[test]
fn picker_view_has_index_aligned_columns_for_declared_inputs_only() {
    struct LeastPrefill;
    impl WorkerPicker for LeastPrefill {
        fn required_worker_inputs(&self) -> WorkerInputs {
            WorkerInputs::LOAD
        }
        fn pick(&self, _: &WorkerSelectionContext<'_>, v: WorkerInputView<'_>) -> R<usize> {
            assert!(v.cache().is_none(), "CACHE not declared");
            let load = v.load().expect("LOAD declared");
            assert_eq!(load.len(), v.candidates().len());
            for (c, s) in v.iter().zip(v.candidates()) {
                assert_eq!(c.worker(), s.worker());
                assert_eq!(s.cost(), 0.0, "no scorers");
            }
            (0..load.len())
                .min_by_key(|&i| load[i].active_prefill_tokens())
                .ok_or_else(|| WorkerSelectionPolicyError::failed("empty"))
        }
    }
    let s = fleet(policy(vec![], Box::new(LeastPrefill)), 3);
    let _a = s.select(&SelectionRequest::new(100).pinned_to_worker(1)).unwrap();
    let _b = s.select(&SelectionRequest::new(50).pinned_to_worker(2)).unwrap();
    assert_eq!(s.select(&SelectionRequest::new(1)).unwrap().worker().worker_id, 3);
    let _c = s.select(&SelectionRequest::new(200).pinned_to_worker(3)).unwrap();
    assert_eq!(s.select(&SelectionRequest::new(1)).unwrap().worker().worker_id, 2);
}

/// A policy built in code is named after its scorers and picker unless it
/// is given a name, and its explanations name the picker that chose: a
/// built-in one by its own name, a user's by its trait's `name`.
#[test]
fn a_composed_policy_is_named_after_its_parts_and_explains_its_picker() {
    let scorers = || -> Vec<Box<dyn WorkerScorer>> {
        vec![
            Box::new(PrefillScorer::new(PrefillParameters::default()).unwrap()),
            Box::new(CacheCreditScorer::new(CacheCreditParameters::default()).unwrap()),
            Box::new(DecodeScorer::new(DecodeParameters::default()).unwrap()),
        ]
    };
    let argmin = policy(scorers(), Box::new(ArgminPicker::new(SeedParameters { seed: Some(3) })));
    assert_eq!(argmin.name(), "prefill+cache-credit+decode/argmin");
    let s = fleet(argmin, 3);
    let e = s.select(&SelectionRequest::new(64).explained()).unwrap().explanation();
    assert_eq!(e.policy, "prefill+cache-credit+decode/argmin");
    let text = e.to_string();
    assert!(
        text.starts_with("prefill+cache-credit+decode/argmin chose ") && text.contains(" via argmin "),
        "{text}"
    );
    assert!(!text.contains("custom"), "{text}");

    // Named: the name given; a user's picker by the name it reports.
    let named = fleet(policy(scorers(), Box::new(Fixed(0))).with_name("my-policy"), 2);
    let text = named.peek(&SelectionRequest::new(64)).unwrap().explanation.to_string();
    assert!(
        text.starts_with("my-policy chose ") && text.contains(" via fixed "),
        "{text}"
    );
    // Without a name of its own, a picker reports its type's name.
    let text = fleet(policy(vec![], Box::new(MinCost)), 1)
        .peek(&SelectionRequest::new(64))
        .unwrap()
        .explanation
        .to_string();
    assert!(
        text.starts_with("plugins::MinCost chose ") && text.contains(" via plugins::MinCost "),
        "{text}"
    );
}

/// An explained choice of a composed policy splits the chosen row's and the
/// runner-up's cost into each scorer's contribution, by the scorer's name;
/// a plain selection computes none of it.
#[test]
fn a_composed_explanation_splits_the_cost_by_scorer() {
    struct ById;
    impl WorkerScorer for ById {
        fn name(&self) -> &'static str {
            "by-id"
        }
        fn score(&self, _: &WorkerSelectionContext<'_>, c: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
            for (cost, c) in costs.iter_mut().zip(c.iter()) {
                *cost = c.worker().worker_id as f64 * 0.1;
            }
            Ok(())
        }
    }
    struct Half;
    impl WorkerScorer for Half {
        fn name(&self) -> &'static str {
            "half"
        }
        fn score(&self, _: &WorkerSelectionContext<'_>, _: WorkerCandidates<'_>, costs: &mut [f64]) -> R<()> {
            costs.fill(0.5);
            Ok(())
        }
    }
    let s = fleet(policy(vec![Box::new(ById), Box::new(Half)], Box::new(MinCost)), 3);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-12 * a.abs().max(1.0);
    let peeked = s.peek(&SelectionRequest::new(1)).unwrap().explanation;
    let selected = s.select(&SelectionRequest::new(1).explained()).unwrap().explanation();
    for e in [peeked, selected] {
        let terms = e.terms.expect("an explained composed choice has its terms");
        let got: Vec<(&str, f64)> = terms.iter().collect();
        assert_eq!(got, [("by-id", 0.1), ("half", 0.5)], "{e}");
        assert!(close(terms.sum(), e.cost), "{e}");
        let runner_up = e.runner_up_terms.expect("and the runner-up's");
        assert_eq!(runner_up.get("by-id"), Some(0.2), "{e}");
        assert!(close(runner_up.sum(), e.runner_up.unwrap().1), "{e}");
        let text = e.to_string();
        assert!(
            text.contains("at cost 0.6000 (by-id 0.1000 + half 0.5000)")
                && text.contains("at 0.7000 (by-id 0.2000 + half 0.5000)"),
            "{text}"
        );
    }
    let plain = s.select(&SelectionRequest::new(1)).unwrap().explanation();
    assert_eq!((plain.terms, plain.runner_up_terms), (None, None));
    // The service keeps the last explained selections' terms: an old
    // booking keeps its runner-up, its terms are gone.
    let held = s.select(&SelectionRequest::new(1).explained()).unwrap();
    assert!(held.explanation().terms.is_some());
    for _ in 0..Explanation::TERMS_KEPT {
        drop(s.select(&SelectionRequest::new(1).explained()).unwrap());
    }
    let e = held.explanation();
    assert!(e.terms.is_none() && e.runner_up.is_some(), "{e}");
}
