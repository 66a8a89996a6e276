//! Parity of selkie's default KV selection with dynamo-kv-router 1.6.1's
//! `DefaultWorkerSelector` on Dynamo's `worker_selection` fixture and on
//! seeded random fleets, without the timing: every worker's cost
//! within 1e-6 relative, every temperature-0 pick at Dynamo's minimum cost,
//! and every temperature-0.7 sampler matching Dynamo's softmax over
//! Dynamo's costs, for selkie's kernel path (fleet and slices) and its
//! public service.
//!
//! ```text
//! cargo test -p selkie-benches --features dynamo --test dynamo_parity
//! ```
use selkie_benches::vs_dynamo::{parity, Scenario, RANDOM_SEED};

#[test]
fn costs_and_picks_match_dynamo_on_its_fixture() {
    // Sampling draws cost one Dynamo selection each: keep them to the small
    // fleets so the test stays quick in a debug build.
    for (workers, samples) in [(2, 4_000), (32, 4_000), (1_024, 400), (10_000, 0)] {
        match parity::check(&Scenario::fixture(workers), samples) {
            Ok(report) => println!("{report}"),
            Err(e) => panic!("{workers} workers: {e}"),
        }
    }
}

#[test]
fn costs_and_picks_match_dynamo_on_random_fleets() {
    for (workers, samples) in [(64, 2_000), (1_024, 400)] {
        match parity::check(&Scenario::random(workers, RANDOM_SEED), samples) {
            Ok(report) => println!("{report}"),
            Err(e) => panic!("random fleet of {workers} workers: {e}"),
        }
    }
}

/// The check is not vacuous: a selkie whose credit weight is off by 1e-5
/// fails it, naming a worker.
#[test]
fn a_slightly_wrong_cost_fails_the_check() {
    use selkie_benches::vs_dynamo::{DynamoFixture, LoadSource, SelkieFixture};
    use selkie_kernel::kernels::kv_cost::KvCostConfig;

    let scenario = Scenario::fixture(32);
    let dynamo = DynamoFixture::new(&scenario);
    let truth = parity::DynamoTruth::new(&dynamo, 32).expect("Dynamo agrees with itself");
    let config = KvCostConfig {
        overlap_score_credit: 1.0 + 1e-5,
        ..KvCostConfig::default()
    };
    let mut selkie = SelkieFixture::new(&scenario, LoadSource::Fleet).with_config(config);
    match parity::check_selkie(&truth, &mut selkie) {
        Err(parity::ParityError::Cost { worker, .. }) => assert!(worker > 0, "worker 0 has no overlap"),
        other => panic!("expected a cost mismatch, got {other:?}"),
    }
}

/// The service check is not vacuous either: a service holding another
/// fleet's load fails it, naming a worker.
#[test]
fn a_service_holding_other_load_fails_the_check() {
    use selkie_benches::vs_dynamo::{DynamoFixture, OverlapForm, ServiceFixture};

    let dynamo = DynamoFixture::new(&Scenario::random(64, 1));
    let truth = parity::DynamoTruth::new(&dynamo, 64).expect("Dynamo agrees with itself");
    let service = ServiceFixture::new(&Scenario::random(64, 2));
    for form in OverlapForm::ALL {
        match parity::check_service(&truth, &service, form) {
            Err(parity::ParityError::Cost { who, .. }) => assert_eq!(who, parity::service_name(form)),
            other => panic!("expected a cost mismatch ({form:?}), got {other:?}"),
        }
    }
}
