//! Pins the block-hash definition: these values are persisted and compared across processes and
//! versions, so a change here is a breaking change of the contract (see docs/block-hash.md).

use serde::Deserialize;
use switchyard_core::{BlockSize, block_hashes};

#[derive(Deserialize)]
struct Vector {
    name: String,
    block_size: u32,
    tokens: Vec<u32>,
    hashes: Vec<String>,
}

#[test]
fn block_hashes_match_the_committed_vectors() {
    let text = include_str!("data/block_hash_vectors.json");
    let vectors: Vec<Vector> = serde_json::from_str(text).unwrap();
    assert!(vectors.len() >= 5);
    for v in vectors {
        let got: Vec<String> = block_hashes(&v.tokens, BlockSize::new(v.block_size).unwrap())
            .iter()
            .map(|h| h.to_string())
            .collect();
        assert_eq!(got, v.hashes, "vector {:?}", v.name);
    }
}
