//! What a request names that decides its routing state, for every front that routes (the
//! four APIs, the admin explain, the endpoint picker): the model or LoRA adapter its `model`
//! names, and the KV identity its `cache_salt` names.

use std::sync::Arc;

use switchyard_core::KvIdentity;

use crate::cluster::pool::{ModelRoutes, WorkerPool};
use crate::error::ApiError;

/// What a request's `model` names: a base model the workers serve, or a LoRA adapter some of
/// them serve, which runs on its base model's routes (tokenizer, context, index) with the
/// adapter's KV, on the workers that serve it.
#[derive(Debug)]
pub struct ServedModel {
    pub routes: Arc<ModelRoutes>,
    pub adapter: Option<String>,
}

/// Resolves `model` (see [`ServedModel`]); an unknown name is a 404, an adapter that workers
/// of two base models claim a 400 naming both.
pub fn served_model(pool: &WorkerPool, model: &str) -> Result<ServedModel, ApiError> {
    if let Some(routes) = pool.model(model) {
        return Ok(ServedModel {
            routes,
            adapter: None,
        });
    }
    match &pool.adapter_models(model)[..] {
        [base] => match pool.model(base) {
            Some(routes) => Ok(ServedModel {
                routes,
                adapter: Some(model.to_owned()),
            }),
            None => Err(ApiError::ModelNotFound(model.to_owned())),
        },
        [] => Err(ApiError::ModelNotFound(model.to_owned())),
        several => Err(ApiError::bad_param(
            "model",
            format!(
                "LoRA adapter `{model}` is served on more than one base model ({}); name a base model",
                several.join(", ")
            ),
        )),
    }
}

/// The KV identity a request's `cache_salt` names, refused by that field's name when invalid.
pub fn salted_identity(cache_salt: Option<String>) -> Result<KvIdentity, ApiError> {
    KvIdentity::new(None, cache_salt).map_err(|e| ApiError::bad_param("cache_salt", e.to_string()))
}
