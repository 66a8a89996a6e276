//! The routing step every front door shares: a parsed request → its
//! prompt's blocks → a [`SelectionRequest`] → the selection service's
//! choice and booking → a [`Choice`] (the worker and the booking's
//! [`Lifecycle`]). Doors parse, forward and stream; they never hash, choose
//! or book themselves.
//!
//! What the request carries depends on what the policy reads:
//!
//! * a policy that reads cache overlaps (`kv`, `device-aware-weighted`, a
//!   composed policy with `cache-credit`) gets each worker rank's overlap
//!   with the prompt from an [`OverlapSource`]: without engine KV events,
//!   [`LearnedOverlaps`], the router's own decisions (a chosen rank is
//!   taken to hold the prompt's blocks for
//!   [`index_ttl`](super::ServeConfig::index_ttl), as Dynamo's approximate
//!   mode);
//! * `prefix-hash` gets the prompt's block hashes (its key is the first
//!   `prefix_blocks` of them);
//! * the load policies get the prompt's length only.
//!
//! A prompt is hashed only when the policy reads it; one that cannot be
//! (see [`Unhashed`]) is routed on load and counted. The prompt's length is
//! then estimated (4 bytes a token) for the booking.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::error::{ApiError, Refusal, ServeError};
use super::lifecycle::Lifecycle;
use super::metrics::Metrics;
use super::overlaps::{LearnedOverlaps, OverlapSource, Recorded};
use super::prompt::{PromptBlocks, PromptHasher, Unhashed};
use super::request::{ParsedRequest, PromptInput};
use super::workers::{ModelRoute, WorkerEntry, WorkerTable};
use crate::kv_index::KvOverlaps;
use crate::{SelectionError, SelectionRequest, WorkerId, WorkerInputs, WorkerSelectionService, WorkerWithDpRank};

/// Prompt text longer than this (bytes) is tokenized on the runtime's
/// blocking pool, not on the thread serving connections.
pub const INLINE_TOKENIZE_BYTES: usize = 4096;

thread_local! {
    /// A thread's overlap columns (the selection reads them in place).
    static OVERLAPS: RefCell<KvOverlaps> = RefCell::new(KvOverlaps::new());
}

/// What the policy reads from a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reads {
    overlaps: bool,
    blocks: bool,
}

/// The routing state shared by every front door.
pub struct RouterCore {
    /// The selection service.
    pub service: Arc<WorkerSelectionService>,
    /// The workers.
    pub table: Arc<WorkerTable>,
    /// Prompts to blocks.
    pub prompts: Arc<PromptHasher>,
    /// Where cache overlaps come from, when the policy reads them.
    pub overlaps: Option<Box<dyn OverlapSource>>,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    reads: Reads,
    block_size: u32,
}

/// A chosen worker and the booking that follows the response.
pub struct Choice {
    /// The worker.
    pub worker: Arc<WorkerEntry>,
    /// The booking.
    pub lifecycle: Lifecycle,
    /// The rank booked.
    pub rank: WorkerWithDpRank,
    /// The prompt tokens the chosen rank was predicted to hold in its
    /// cache (whole blocks), when the policy read cache overlaps; none
    /// after a retry moved the request to another worker.
    pub predicted_cached_tokens: Option<usize>,
    retry: Retry,
}

/// What a retry on the next choice needs.
struct Retry {
    /// The request named its worker: no other may serve it.
    named: bool,
    route: ModelRoute,
    tried: Vec<WorkerId>,
    tokens: usize,
}

impl RouterCore {
    /// The core over `service`'s policy, its index sized by the arguments.
    ///
    /// The service's block size is the one source: the router's own
    /// overlap index takes it, and `prompts` (and its engine hash chain, if
    /// any) must cut blocks of it, or the core is refused
    /// ([`ServeError::BlockSizeMismatch`]).
    pub fn new(
        service: Arc<WorkerSelectionService>,
        table: Arc<WorkerTable>,
        prompts: PromptHasher,
        metrics: Arc<Metrics>,
        index_ttl: Duration,
        max_index_blocks: usize,
    ) -> Result<Self, ServeError> {
        prompts.check_block_size(service.config().block_size)?;
        let policy = service.policy();
        let reads = Reads {
            overlaps: policy.required_worker_inputs().contains(WorkerInputs::CACHE),
            blocks: policy.name() == "prefix-hash",
        };
        let block_size = service.config().block_size;
        Ok(RouterCore {
            overlaps: reads.overlaps.then(|| {
                Box::new(LearnedOverlaps::new(block_size, index_ttl, max_index_blocks)) as Box<dyn OverlapSource>
            }),
            service,
            table,
            prompts: Arc::new(prompts),
            metrics,
            reads,
            block_size,
        })
    }

    /// Takes cache overlaps from `source` (when the policy reads them)
    /// instead of the router's own decisions. A source whose
    /// [`block_size`](OverlapSource::block_size) is not the service's is
    /// refused ([`ServeError::BlockSizeMismatch`]).
    pub fn with_overlaps(mut self, source: Box<dyn OverlapSource>) -> Result<Self, ServeError> {
        if let Some(block_size) = source.block_size().filter(|&b| b != self.block_size) {
            return Err(ServeError::BlockSizeMismatch {
                part: "overlap source",
                block_size,
                service: self.block_size,
            });
        }
        if self.reads.overlaps {
            self.overlaps = Some(source);
        }
        Ok(self)
    }

    /// Whether the policy reads prompts (so they are tokenized and hashed).
    pub fn reads_prompts(&self) -> bool {
        self.reads.overlaps || self.reads.blocks
    }

    /// The worker a request names (`x-selkie-worker`: its URL), if known.
    pub fn named_worker(&self, url: &str) -> Result<WorkerId, ApiError> {
        let unknown = || {
            ApiError::new(
                Refusal::WorkerNotNamed,
                format!("x-selkie-worker names {url:?}, which is not a worker of this router"),
            )
        };
        let parsed = super::workers::WorkerUrl::parse(url).map_err(|_| unknown())?;
        self.table
            .view()
            .workers()
            .iter()
            .find(|w| w.url == parsed)
            .map(|w| w.id)
            .ok_or_else(unknown)
    }

    /// The prompt's blocks, tokenizing long text off the runtime's threads.
    async fn blocks(&self, prompt: &PromptInput<'_>) -> Result<PromptBlocks, Unhashed> {
        if self.prompts.text_bytes(prompt) <= INLINE_TOKENIZE_BYTES {
            return self.prompts.blocks(prompt);
        }
        let owned = match prompt {
            PromptInput::Text(t) => Owned::Text(t.to_string()),
            PromptInput::Chat(raw) => Owned::Chat((*raw).to_owned()),
            other => return self.prompts.blocks(other),
        };
        let prompts = self.prompts.clone();
        tokio::task::spawn_blocking(move || match &owned {
            Owned::Text(t) => prompts.blocks(&PromptInput::Text(t.as_str().into())),
            Owned::Chat(raw) => prompts.blocks(&PromptInput::Chat(raw)),
        })
        .await
        .unwrap_or(Err(Unhashed::TokenizerFailed))
    }

    /// Chooses a worker for `request` (among those serving its model, or
    /// the one it names) and books it.
    pub async fn choose(&self, request: &ParsedRequest<'_>, named: Option<WorkerId>) -> Result<Choice, ApiError> {
        self.choose_in(request, named, None).await
    }

    /// Chooses and books as [`choose`](Self::choose), only among the
    /// workers of `subset` (an endpoint picker's proxy allows those): 503
    /// when none of them serves the model.
    pub async fn choose_among(&self, request: &ParsedRequest<'_>, subset: &[WorkerId]) -> Result<Choice, ApiError> {
        self.choose_in(request, None, Some(subset)).await
    }

    async fn choose_in(
        &self,
        request: &ParsedRequest<'_>,
        named: Option<WorkerId>,
        subset: Option<&[WorkerId]>,
    ) -> Result<Choice, ApiError> {
        let view = self.table.view();
        let mut route = view.route(&request.model).clone();
        if route == ModelRoute::Unknown {
            return Err(ApiError::new(
                Refusal::ModelNotFound,
                format!("no worker serves the model {:?}", request.model),
            ));
        }
        if let Some(subset) = subset {
            let ids: Vec<WorkerId> = match &route {
                ModelRoute::Only(ids) => ids.iter().copied().filter(|id| subset.contains(id)).collect(),
                _ => subset.to_vec(),
            };
            if ids.is_empty() {
                return Err(ApiError::new(
                    Refusal::NoWorkers,
                    format!(
                        "none of the {} endpoints the proxy allows serves the model {:?}",
                        subset.len(),
                        request.model
                    ),
                ));
            }
            route = ModelRoute::Only(ids.into());
        }
        let blocks = if self.reads_prompts() {
            match self.blocks(&request.prompt).await {
                Ok(b) => Some(b),
                Err(reason) => {
                    self.metrics.unhashed(reason);
                    if reason == Unhashed::PromptTooLong && self.prompts.text_bytes(&request.prompt) > 0 {
                        self.metrics.bound_hit("max_tokenize_bytes");
                    }
                    None
                }
            }
        } else {
            None
        };
        let tokens = blocks
            .as_ref()
            .map_or_else(|| request.prompt.estimated_tokens(), |b| b.tokens);
        let allowed: &[WorkerId] = match &route {
            ModelRoute::Only(ids) => ids,
            _ => &[],
        };
        let (booking, seconds, held) = self.select(tokens, allowed, named, blocks.as_ref())?;
        let rank = booking.worker();
        let predicted_cached_tokens = match (&self.overlaps, &blocks) {
            (Some(_), Some(_)) => Some(held * self.block_size as usize),
            _ => None,
        };
        self.metrics.selected(booking.explanation().via(), seconds);
        let mut in_flight = None;
        if let (Some(source), Some(b)) = (&self.overlaps, &blocks) {
            match source.chosen(rank, b, held) {
                Recorded::Full => self.metrics.bound_hit("max_index_blocks"),
                Recorded::Yes => self.metrics.index_blocks(source.blocks()),
                Recorded::Unneeded => {}
            }
            in_flight = source.in_flight(rank, b);
        }
        let lifecycle = Lifecycle::new(
            booking,
            self.metrics.clone(),
            self.block_size,
            tokens,
            request.max_tokens,
            request.stream,
        )
        .with_in_flight(in_flight);
        let mut rank = rank;
        let mut lifecycle = lifecycle;
        let mut retry = Retry {
            named: named.is_some(),
            route,
            tried: Vec::new(),
            tokens,
        };
        let mut predicted_cached_tokens = predicted_cached_tokens;
        let worker = match self.table.get(rank.worker_id, &self.service) {
            Some(w) => w,
            // The worker left between the selection and now.
            None => match self.move_on(&mut lifecycle, &mut rank, &mut retry) {
                Ok(w) => {
                    predicted_cached_tokens = None;
                    w
                }
                Err(e) => {
                    lifecycle.end(super::lifecycle::Ending::Refused);
                    return Err(e);
                }
            },
        };
        Ok(Choice {
            worker,
            lifecycle,
            rank,
            predicted_cached_tokens,
            retry,
        })
    }

    /// Selects and books; also returns the seconds it took and how many
    /// of the prompt's blocks the chosen rank held.
    fn select(
        &self,
        tokens: usize,
        allowed: &[WorkerId],
        named: Option<WorkerId>,
        blocks: Option<&PromptBlocks>,
    ) -> Result<(crate::OwnedSelection, f64, usize), ApiError> {
        let mut req = SelectionRequest::new(tokens);
        if !allowed.is_empty() {
            req = req.with_allowed_workers(allowed);
        }
        if let Some(id) = named {
            req = req.pinned_to_worker(id);
        }
        if let (true, Some(b)) = (self.reads.blocks, blocks) {
            req = req.with_prompt_blocks(&b.sequence);
        }
        let started = Instant::now();
        let result = match (&self.overlaps, blocks) {
            (Some(source), Some(b)) if !b.sequence.is_empty() => OVERLAPS.with(|cell| {
                let mut out = cell.borrow_mut();
                let Some(overlaps) = source.overlaps(&self.service, &b.sequence, &mut out) else {
                    return self.service.select_owned(&req).map(|s| (s, 0));
                };
                let held_on = |s: &crate::OwnedSelection| {
                    self.service
                        .row_of(s.worker())
                        .and_then(|row| overlaps.device_blocks.get(row))
                        .map_or(0, |&v| v as usize)
                };
                match self.service.select_owned(&req.with_row_overlaps(overlaps)) {
                    Ok(s) => {
                        let held = held_on(&s);
                        Ok((s, held))
                    }
                    // A worker got or lost a row since the query: the
                    // overlaps no longer fit the rows.
                    Err(SelectionError::StaleRowLayout { .. }) => self.service.select_owned(&req).map(|s| (s, 0)),
                    Err(e) => Err(e),
                }
            }),
            _ => self.service.select_owned(&req).map(|s| (s, 0)),
        };
        let seconds = started.elapsed().as_secs_f64();
        result
            .map(|(b, held)| (b, seconds, held))
            .map_err(|e| ApiError::from_selection(&e))
    }

    /// The workers after `choice`'s, best first, as the policy ranks them
    /// now (by its cost without cache credit), among those that may serve
    /// the request (its model's, `subset`'s when given), at most `most`.
    /// A worker appears once, at its best rank.
    pub fn fallbacks(&self, choice: &Choice, subset: Option<&[WorkerId]>, most: usize) -> Vec<Arc<WorkerEntry>> {
        if most == 0 {
            return Vec::new();
        }
        let mut req = SelectionRequest::new(choice.retry.tokens);
        if let ModelRoute::Only(ids) = &choice.retry.route {
            req = req.with_allowed_workers(ids);
        } else if let Some(ids) = subset {
            req = req.with_allowed_workers(ids);
        }
        let Ok(mut costs) = self.service.costs(&req) else {
            return Vec::new();
        };
        costs.sort_by(|a, b| a.1.total_cmp(&b.1));
        let view = self.table.view();
        let mut out: Vec<Arc<WorkerEntry>> = Vec::with_capacity(most);
        for (rank, _) in costs {
            if out.len() == most {
                break;
            }
            if rank.worker_id == choice.worker.id || out.iter().any(|w| w.id == rank.worker_id) {
                continue;
            }
            if let Some(w) = view.get(rank.worker_id) {
                out.push(w.clone());
            }
        }
        out
    }

    /// Moves `choice`'s booking to `worker` (its best rank now, else its
    /// first), where the proxy says it sent the request: the request is
    /// there whatever the filters say, so a busy mark does not stop the
    /// move; only the worker's admission limit does (the booking then
    /// stays where it was).
    pub fn moved_to(&self, choice: &mut Choice, worker: Arc<WorkerEntry>) -> Result<(), ApiError> {
        let req = SelectionRequest::new(choice.retry.tokens).pinned_to_worker(worker.id);
        let next = self
            .service
            .peek(&req)
            .map_or(WorkerWithDpRank::new(worker.id, worker.dp.0), |p| p.worker);
        choice
            .lifecycle
            .retarget(next)
            .map_err(|e| ApiError::new(Refusal::SelectionFailed, format!("cannot move the booking: {e}")))?;
        choice.rank = next;
        choice.worker = worker;
        choice.predicted_cached_tokens = None;
        Ok(())
    }

    /// The worker refused the connection: moves the booking to the next
    /// choice among the workers not tried (once; the booking is moved, never
    /// doubled). 502 when there is none.
    pub fn next_choice(&self, choice: &mut Choice) -> Result<(), ApiError> {
        choice.worker = self.move_on(&mut choice.lifecycle, &mut choice.rank, &mut choice.retry)?;
        choice.predicted_cached_tokens = None;
        Ok(())
    }

    fn move_on(
        &self,
        lifecycle: &mut Lifecycle,
        rank: &mut WorkerWithDpRank,
        retry: &mut Retry,
    ) -> Result<Arc<WorkerEntry>, ApiError> {
        if let Some(source) = &self.overlaps {
            source.unreachable(rank.worker_id);
        }
        retry.tried.push(rank.worker_id);
        let view = self.table.view();
        let candidates: Vec<WorkerId> = match &retry.route {
            ModelRoute::Only(ids) => ids.iter().copied().filter(|id| !retry.tried.contains(id)).collect(),
            _ => view
                .workers()
                .iter()
                .map(|w| w.id)
                .filter(|id| !retry.tried.contains(id))
                .collect(),
        };
        let unreachable = |why: String| {
            ApiError::new(
                Refusal::UpstreamUnreachable,
                format!("the chosen worker refused the connection and {why}"),
            )
        };
        if retry.named {
            return Err(unreachable("the request names it (x-selkie-worker)".into()));
        }
        if candidates.is_empty() {
            return Err(unreachable("no other worker serves the model".into()));
        }
        let req = SelectionRequest::new(retry.tokens).with_allowed_workers(&candidates);
        let next = self
            .service
            .peek(&req)
            .map_err(|e| unreachable(format!("no other worker can take it ({e})")))?
            .worker;
        lifecycle
            .retarget(next)
            .map_err(|e| unreachable(format!("the next choice refused the booking ({e})")))?;
        *rank = next;
        self.metrics.retried();
        self.table
            .get(next.worker_id, &self.service)
            .ok_or_else(|| unreachable("the next choice left the fleet".into()))
    }
}

/// A prompt moved to the blocking pool.
enum Owned {
    Text(String),
    Chat(Box<serde_json::value::RawValue>),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::router::kv_events::Sha256CborChain;
    use crate::router::{build_policy, Limits, PolicySpec};
    use crate::{KvRouterConfig, ServiceConfig, WorkerSelectionPolicy, WorkerType};

    fn core(service: &Arc<WorkerSelectionService>, prompts: PromptHasher) -> Result<RouterCore, ServeError> {
        let metrics = Arc::new(Metrics::new("kv", &Limits::default()));
        let table = Arc::new(WorkerTable::new());
        RouterCore::new(service.clone(), table, prompts, metrics, Duration::from_secs(60), 1_000)
    }

    fn prompts(block_size: u32) -> PromptHasher {
        PromptHasher::new(block_size, None, None, 1 << 20, 1 << 20)
    }

    #[test]
    fn parts_of_another_block_size_than_the_service_are_refused() {
        let service = Arc::new(WorkerSelectionService::new(
            WorkerSelectionPolicy::kv(KvRouterConfig::default(), WorkerType::Aggregated),
            ServiceConfig::default(),
        ));
        let refused = |r: Result<RouterCore, ServeError>| match r {
            Err(ServeError::BlockSizeMismatch {
                part,
                block_size,
                service,
            }) => (part, block_size, service),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("accepted"),
        };
        assert_eq!(refused(core(&service, prompts(32))), ("prompt hasher", 32, 16));
        let chained = prompts(16).with_engine_chain(Sha256CborChain::new(32, None));
        assert_eq!(refused(core(&service, chained)), ("engine hash chain", 32, 16));
        let learned = |bs| Box::new(LearnedOverlaps::new(bs, Duration::from_secs(60), 10));
        let ok = || core(&service, prompts(16)).unwrap();
        assert_eq!(refused(ok().with_overlaps(learned(32))), ("overlap source", 32, 16));
        assert!(ok().with_overlaps(learned(16)).is_ok());
        assert_eq!(
            ServeError::BlockSizeMismatch {
                part: "overlap source",
                block_size: 32,
                service: 16
            }
            .to_string(),
            "the overlap source counts blocks of 32 tokens but the selection service blocks of 16: build it with the \
             service's block size"
        );
    }

    #[test]
    fn a_config_of_another_block_size_is_converted_to_the_routers() {
        let dir = std::env::temp_dir().join(format!("selkie-route-bs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tuned.yaml");
        let yaml = "block_size: 512\naggregated: t\ninstances:\n  - { name: t, type: kv, parameters: { switch_margin: 2.5 } }\n";
        std::fs::write(&path, yaml).unwrap();
        let spec = PolicySpec::ConfigFile(path);
        let at_16 = build_policy(&spec, 16).unwrap();
        assert_eq!(
            at_16.kv_router_config().switch_margin,
            80.0,
            "2.5 blocks of 512 tokens are 80 of 16"
        );
        assert_eq!(build_policy(&spec, 512).unwrap().kv_router_config().switch_margin, 2.5);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
