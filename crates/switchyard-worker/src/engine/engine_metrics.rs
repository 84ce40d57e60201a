//! Reading an engine's Prometheus `/metrics` into [`LoadStats`] and its cache facts.
//!
//! vLLM: `vllm:num_requests_waiting`, `vllm:num_requests_running`, `vllm:kv_cache_usage_perc`
//! (`vllm:gpu_cache_usage_perc` before v0.10), counters `vllm:num_preemptions_total`,
//! `vllm:prompt_tokens_total`, `vllm:prefix_cache_hits_total`, and `vllm:cache_config_info`
//! whose labels carry `block_size` and `num_gpu_blocks`.
//! SGLang: `sglang:num_queue_reqs`, `sglang:num_running_reqs`, `sglang:token_usage`,
//! `sglang:max_total_num_tokens`, `sglang:prompt_tokens_total`, `sglang:cached_tokens_total`;
//! its page size is not a metric and comes from `/get_server_info` (see `vllm.rs`).
//! Values are summed over label sets (one per model or engine index).

use switchyard_core::promtext::{Sample, parse};
use switchyard_core::{EngineKind, LoadStats};

/// The parsed samples of one scrape.
#[derive(Debug, Clone, Default)]
pub struct Scrape(pub Vec<Sample>);

impl Scrape {
    pub fn from_text(text: &str) -> Self {
        Self(parse(text))
    }

    /// Sum over every label set of the first of `names` that is present.
    pub fn sum(&self, names: &[&str]) -> Option<f64> {
        names.iter().find_map(|name| {
            let mut found = false;
            let total = self
                .0
                .iter()
                .filter(|s| s.name == *name && s.value.is_finite())
                .inspect(|_| found = true)
                .map(|s| s.value)
                .sum();
            found.then_some(total)
        })
    }

    /// A label of the first sample named `name` that has it.
    pub fn label(&self, name: &str, label: &str) -> Option<&str> {
        self.0
            .iter()
            .filter(|s| s.name == name)
            .find_map(|s| s.labels.iter().find(|(k, _)| k == label))
            .map(|(_, v)| v.as_str())
    }

    /// Block size and device blocks, when the engine publishes them as metrics.
    pub fn cache_facts(&self, kind: EngineKind) -> (Option<u32>, Option<u64>) {
        let parse_label = |name: &str, label: &str| {
            self.label(name, label)
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v > 0.0)
        };
        match kind {
            EngineKind::Sglang => {
                let page = parse_label("sglang:cache_config_info", "page_size");
                let tokens = self.sum(&["sglang:max_total_num_tokens"]);
                let blocks = match (page, tokens) {
                    (Some(p), Some(t)) if p > 0.0 => Some((t / p).floor() as u64),
                    _ => None,
                };
                (page.map(|p| p as u32), blocks)
            }
            _ => (
                parse_label("vllm:cache_config_info", "block_size").map(|b| b as u32),
                parse_label("vllm:cache_config_info", "num_gpu_blocks").map(|b| b as u64),
            ),
        }
    }

    /// Load figures; `capacity_blocks` is the registered capacity the usage fraction scales.
    pub fn load(&self, kind: EngineKind, capacity_blocks: u64) -> LoadStats {
        let n = |names: &[&str]| self.sum(names).map_or(0, |v| v.max(0.0).round() as u64);
        let (waiting, running, usage, preempt, prompt, cached) = match kind {
            EngineKind::Sglang => (
                n(&["sglang:num_queue_reqs"]),
                n(&["sglang:num_running_reqs"]),
                self.sum(&["sglang:token_usage"]),
                n(&[
                    "sglang:num_retracted_reqs_total",
                    "sglang:num_retracted_reqs",
                ]),
                n(&["sglang:prompt_tokens_total"]),
                n(&["sglang:cached_tokens_total"]),
            ),
            _ => (
                n(&["vllm:num_requests_waiting"]),
                n(&["vllm:num_requests_running"]),
                self.sum(&["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"]),
                n(&["vllm:num_preemptions_total", "vllm:num_preemptions"]),
                n(&["vllm:prompt_tokens_total", "vllm:prompt_tokens"]),
                n(&["vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"]),
            ),
        };
        // The usage fraction counts blocks referenced by running requests (cached but free
        // blocks are reusable and not counted).
        let used = usage.map_or(0, |u| {
            (u.clamp(0.0, 1.0) * capacity_blocks as f64).round() as u64
        });
        LoadStats {
            queued_prefill_tokens: 0,
            waiting_requests: waiting,
            running_requests: running,
            active_decode_sequences: running,
            active_blocks: used,
            used_blocks: used,
            capacity_blocks,
            preemptions_total: preempt,
            cached_prompt_tokens_total: cached,
            prompt_tokens_total: prompt,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &str = r#"
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",num_gpu_blocks="1000",prefix_caching_hash_algo="sha256"} 1.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.28e+02
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="m"} 5.0
"#;

    #[test]
    fn vllm_metrics_become_load_and_cache_facts() {
        let scrape = Scrape::from_text(VLLM);
        assert_eq!(scrape.cache_facts(EngineKind::Vllm), (Some(16), Some(1000)));
        let load = scrape.load(EngineKind::Vllm, 1000);
        assert_eq!(load.running_requests, 4);
        assert_eq!(load.waiting_requests, 2);
        assert_eq!(load.active_blocks, 250);
        assert_eq!(load.prompt_tokens_total, 128);
        assert_eq!(load.cached_prompt_tokens_total, 64);
    }

    #[test]
    fn sglang_and_old_vllm_names() {
        let text = "sglang:num_queue_reqs{model_name=\"m\"} 5\nsglang:num_running_reqs 2\nsglang:token_usage 0.5\nsglang:max_total_num_tokens 1600\nsglang:cache_config_info{page_size=\"16\"} 1\n";
        let scrape = Scrape::from_text(text);
        assert_eq!(
            scrape.cache_facts(EngineKind::Sglang),
            (Some(16), Some(100))
        );
        let load = scrape.load(EngineKind::Sglang, 100);
        assert_eq!((load.waiting_requests, load.running_requests), (5, 2));
        assert_eq!(load.used_blocks, 50);
        let old = Scrape::from_text("vllm:gpu_cache_usage_perc 1.5\n");
        assert_eq!(old.load(EngineKind::Vllm, 10).used_blocks, 10);
    }

    #[test]
    fn labels_with_escapes_and_garbage_lines() {
        let s =
            parse("a{x=\"1,2\",y=\"q\\\"z\"} 7\nnot a metric line at all\nb 1 1700000000\n{}\n");
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].labels[0], ("x".into(), "1,2".into()));
        assert_eq!(s[0].labels[1], ("y".into(), "q\"z".into()));
        assert_eq!(s[1].value, 1.0);
    }
}
