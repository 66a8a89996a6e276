//! Built-in scorers and pickers to combine with one's own in a custom
//! policy (in code with [`WorkerSelectionPolicy::new`](crate::WorkerSelectionPolicy::new),
//! or by type name in a `composed` policy of a config file).
//!
//! * `scorers`: the default KV cost's terms (`prefill`, `decode`,
//!   `cache-credit`, `preferred-taints`).
//! * `pickers`: `argmin`, `softmax` and `power-of-two` over the summed costs.
//!
//! Everything here goes through the public plugin traits: nothing may reach
//! into the host's selection internals.

mod pickers;
mod scorers;

pub use pickers::{ArgminPicker, PowerOfTwoPicker, SeedParameters, SoftmaxParameters, SoftmaxPicker};
pub use scorers::{
    CacheCreditParameters, CacheCreditScorer, DecodeParameters, DecodeScorer, PreferredTaintScorer, PrefillParameters,
    PrefillScorer,
};
