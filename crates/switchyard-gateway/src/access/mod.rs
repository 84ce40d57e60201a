//! Who may use the gateway, and how much.
//!
//! [`listener`] is the listener's protection (API keys, the metrics token, HTTPS);
//! [`api_keys`] the keys and their tenants; [`quota`] per-tenant token and request budgets
//! (in memory or Redis); [`admission`] the fair sharing of the serving slots among flows,
//! with priorities.

pub mod admission;
pub mod api_keys;
pub mod listener;
pub mod quota;
