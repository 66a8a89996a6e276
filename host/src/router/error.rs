//! The router's errors: [`ServeError`] (the router cannot start) and
//! [`ApiError`] (one request is refused, with the HTTP status and the
//! OpenAI-shaped JSON body a client expects).
//!
//! This module formats; it decides nothing. Which status a refusal gets is
//! stated once here, on [`Refusal`], for every front door.

use std::path::PathBuf;

use bytes::Bytes;
use thiserror::Error;

use crate::{ConfigError, DiscoveryError, RegistryError, SelectionError};

/// Why `selkie serve` could not start.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServeError {
    /// An option is out of range.
    #[error("{option} = {value}: {bound}")]
    Invalid {
        /// The option (`--max-body-bytes`).
        option: &'static str,
        /// Its value.
        value: String,
        /// What it must be.
        bound: String,
    },
    /// The connection bounds need more file descriptors than the process
    /// may open.
    #[error(
        "--max-connections {max_connections} + --max-concurrent-requests {max_concurrent_requests} + {} reserved \
         need {needed} open files, but the limit is {limit}: lower them or raise the limit (ulimit -n)",
        super::config::RESERVED_FDS
    )]
    OpenFiles {
        /// `--max-connections`.
        max_connections: usize,
        /// `--max-concurrent-requests`.
        max_concurrent_requests: usize,
        /// What they need.
        needed: u64,
        /// The open-files limit (soft, after raising it to the hard one).
        limit: u64,
    },
    /// No source of workers was given.
    #[error("no workers: give --worker URL, --workers-file FILE or etcd options")]
    NoWorkerSource,
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The tokenizer file could not be loaded.
    #[error("tokenizer {}: {message}", path.display())]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The tokenizers crate's message.
        message: String,
    },
    /// The chat template does not parse.
    #[error("chat template {}: {message}", path.display())]
    ChatTemplate {
        /// The file.
        path: PathBuf,
        /// minijinja's message (with the line).
        message: String,
    },
    /// A workers file is malformed.
    #[error("workers file {}: {message}", path.display())]
    WorkersFile {
        /// The file.
        path: PathBuf,
        /// What is wrong, with the entry.
        message: String,
    },
    /// The policy type or its parameters are refused.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// The worker-selection config file is refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The workers were refused (an invalid record, a fleet too small) or
    /// etcd could not be reached.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// The listening socket could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: std::net::SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// The async runtime or a thread could not start.
    #[error("cannot start the runtime: {0}")]
    Runtime(std::io::Error),
    /// A part of the router counts blocks of another size than its
    /// selection service ([`ServiceConfig::block_size`](crate::ServiceConfig::block_size)):
    /// its overlaps or block hashes would be read in the service's blocks.
    /// Refused where the part meets the service
    /// ([`RouterCore::new`](super::RouterCore::new),
    /// [`RouterCore::with_overlaps`](super::RouterCore::with_overlaps)).
    #[error(
        "the {part} counts blocks of {block_size} tokens but the selection service blocks of {service}: build it \
         with the service's block size"
    )]
    BlockSizeMismatch {
        /// `prompt hasher`, `engine hash chain` or `overlap source`.
        part: &'static str,
        /// Its block size.
        block_size: u32,
        /// The service's.
        service: u32,
    },
}

/// Every reason the router refuses a request or cuts it short, with its
/// HTTP status: the label of `selkie_refusals_total{reason}` and the
/// `code` of the JSON error body.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Refusal {
    /// 400: the body is not JSON (or not a JSON object).
    MalformedJson,
    /// 400: no `model`.
    MissingModel,
    /// 400: no `prompt` (completions) or `messages` (chat).
    MissingPrompt,
    /// 400: a field has the wrong type (`stream` not a boolean, a prompt
    /// that is neither text nor token ids, ...).
    InvalidField,
    /// 400: the `direct` policy got a request that names no worker
    /// (`x-selkie-worker`), or it names one the router does not know.
    WorkerNotNamed,
    /// 404: no worker serves the model.
    ModelNotFound,
    /// 404: no such path.
    NotFound,
    /// 405: the path takes another method.
    MethodNotAllowed,
    /// 408: the client took longer than `body_read_timeout` to send its
    /// body.
    BodyTimeout,
    /// 413: the body is over `max_body_bytes`.
    BodyTooLarge,
    /// 429: every eligible worker is at its admission limit (or busy).
    WorkersAtCapacity,
    /// 503: the router holds `max_concurrent_requests` already.
    RouterAtCapacity,
    /// 503: no worker at all, or none eligible.
    NoWorkers,
    /// 503: the router is shutting down.
    ShuttingDown,
    /// 502: the worker refused the connection, and so did the next choice
    /// (or there was none).
    UpstreamUnreachable,
    /// 502: the worker broke the connection before its response head.
    UpstreamFailed,
    /// 504: the worker's response head did not come within
    /// `response_timeout`.
    UpstreamTimeout,
    /// 500: the policy failed (a plugin error).
    SelectionFailed,
}

impl Refusal {
    /// The HTTP status.
    pub const fn status(self) -> u16 {
        match self {
            Refusal::MalformedJson
            | Refusal::MissingModel
            | Refusal::MissingPrompt
            | Refusal::InvalidField
            | Refusal::WorkerNotNamed => 400,
            Refusal::ModelNotFound | Refusal::NotFound => 404,
            Refusal::MethodNotAllowed => 405,
            Refusal::BodyTimeout => 408,
            Refusal::BodyTooLarge => 413,
            Refusal::WorkersAtCapacity => 429,
            Refusal::RouterAtCapacity | Refusal::NoWorkers | Refusal::ShuttingDown => 503,
            Refusal::UpstreamUnreachable | Refusal::UpstreamFailed => 502,
            Refusal::UpstreamTimeout => 504,
            Refusal::SelectionFailed => 500,
        }
    }

    /// The label (`selkie_refusals_total{reason}`, the body's `code`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Refusal::MalformedJson => "malformed_json",
            Refusal::MissingModel => "missing_model",
            Refusal::MissingPrompt => "missing_prompt",
            Refusal::InvalidField => "invalid_field",
            Refusal::WorkerNotNamed => "worker_not_named",
            Refusal::ModelNotFound => "model_not_found",
            Refusal::NotFound => "not_found",
            Refusal::MethodNotAllowed => "method_not_allowed",
            Refusal::BodyTimeout => "body_timeout",
            Refusal::BodyTooLarge => "body_too_large",
            Refusal::WorkersAtCapacity => "workers_at_capacity",
            Refusal::RouterAtCapacity => "router_at_capacity",
            Refusal::NoWorkers => "no_workers",
            Refusal::ShuttingDown => "shutting_down",
            Refusal::UpstreamUnreachable => "upstream_unreachable",
            Refusal::UpstreamFailed => "upstream_failed",
            Refusal::UpstreamTimeout => "upstream_timeout",
            Refusal::SelectionFailed => "selection_failed",
        }
    }

    /// The OpenAI error `type`.
    const fn error_type(self) -> &'static str {
        match self.status() {
            400 | 405 | 408 | 413 => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            _ => "server_error",
        }
    }

    /// Whether the response carries `Retry-After`.
    pub const fn retry_after(self) -> bool {
        matches!(
            self,
            Refusal::WorkersAtCapacity | Refusal::RouterAtCapacity | Refusal::NoWorkers | Refusal::ShuttingDown
        )
    }

    /// Every refusal, for metrics registered up front.
    pub const ALL: [Refusal; 18] = [
        Refusal::MalformedJson,
        Refusal::MissingModel,
        Refusal::MissingPrompt,
        Refusal::InvalidField,
        Refusal::WorkerNotNamed,
        Refusal::ModelNotFound,
        Refusal::NotFound,
        Refusal::MethodNotAllowed,
        Refusal::BodyTimeout,
        Refusal::BodyTooLarge,
        Refusal::WorkersAtCapacity,
        Refusal::RouterAtCapacity,
        Refusal::NoWorkers,
        Refusal::ShuttingDown,
        Refusal::UpstreamUnreachable,
        Refusal::UpstreamFailed,
        Refusal::UpstreamTimeout,
        Refusal::SelectionFailed,
    ];
}

/// A refused request: the reason and a message that says what was wrong.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error("{} {}: {message}", reason.status(), reason.as_str())]
pub struct ApiError {
    /// Why.
    pub reason: Refusal,
    /// For the client: what was wrong, with the field, value or bound.
    pub message: String,
}

impl ApiError {
    /// A refusal with its message.
    pub fn new(reason: Refusal, message: impl Into<String>) -> Self {
        ApiError {
            reason,
            message: message.into(),
        }
    }

    /// The JSON body, in OpenAI's shape:
    /// `{"error": {"message", "type", "param", "code"}}`.
    ///
    /// ```
    /// use selkie::router::{ApiError, Refusal};
    /// let body = ApiError::new(Refusal::MissingModel, "the request has no \"model\"").body();
    /// let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    /// assert_eq!(v["error"]["code"], "missing_model");
    /// assert_eq!(v["error"]["type"], "invalid_request_error");
    /// ```
    pub fn body(&self) -> Bytes {
        let v = serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.reason.error_type(),
                "param": null,
                "code": self.reason.as_str(),
            }
        });
        Bytes::from(v.to_string())
    }

    /// The refusal a failed selection gets.
    pub fn from_selection(e: &SelectionError) -> Self {
        let reason = match e {
            e if e.is_overload() => Refusal::WorkersAtCapacity,
            SelectionError::NoEndpoints | SelectionError::NoEligibleWorkers { .. } => Refusal::NoWorkers,
            SelectionError::AllEligibleWorkersFiltered => Refusal::NoWorkers,
            SelectionError::DirectWorkerMissing
            | SelectionError::PinnedWorkerNotAllowed { .. }
            | SelectionError::PinnedWorkerUnavailable { .. }
            | SelectionError::DpRankUnavailable { .. } => Refusal::WorkerNotNamed,
            _ => Refusal::SelectionFailed,
        };
        let message = match reason {
            Refusal::WorkersAtCapacity => format!("every eligible worker is at its admission limit ({e}); retry later"),
            Refusal::NoWorkers => format!("no worker can take the request ({e})"),
            Refusal::WorkerNotNamed => format!("{e} (name a known worker in the x-selkie-worker header)"),
            _ => format!("worker selection failed: {e}"),
        };
        ApiError::new(reason, message)
    }
}
