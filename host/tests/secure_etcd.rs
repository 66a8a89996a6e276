//! placeholder
mod servers;
