//! The request pipeline the four APIs share (chat and text completions, Responses, Messages):
//! [`serve`] runs it (read, take apart, validate, admit, tokenize, prepare, then answer through
//! the API's renderer), [`prepared`] holds what it decides and how it counts and refuses a
//! request. It knows each API only by its [`Api`] descriptor and its renderer, and imports none
//! of them.

pub(crate) mod prepared;
pub(crate) mod serve;

pub use prepared::{Api, ParsedRequest, ServedModel, Shape, salted_identity, served_model};
pub(crate) use prepared::{checked, fail, model_routes, parse_body, read_body, session_of};
pub(crate) use serve::{Incoming, Peer, handle};
