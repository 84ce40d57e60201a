//! Which replica owns a session: rendezvous (highest-random-weight) hashing of the session id
//! over the live replicas. Every replica computes the same owner from the same list, and when
//! a replica joins or leaves only the sessions it wins or held move: the others keep their
//! owner.

use switchyard_registry::ReplicaInfo;
use xxhash_rust::xxh3::xxh3_64;

/// The replica that owns `session` among `replicas` (None when there are none).
pub fn owner<'a>(session: &str, replicas: &'a [ReplicaInfo]) -> Option<&'a ReplicaInfo> {
    replicas
        .iter()
        .max_by_key(|replica| (weight(&replica.id, session), &replica.id))
}

/// The replica's weight for the session: a stable 64-bit hash of both (the same in every
/// process and version, unlike std's hasher).
fn weight(replica: &str, session: &str) -> u64 {
    let mut key = Vec::with_capacity(replica.len() + 1 + session.len());
    key.extend_from_slice(replica.as_bytes());
    key.push(0);
    key.extend_from_slice(session.as_bytes());
    xxh3_64(&key)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replicas(ids: &[&str]) -> Vec<ReplicaInfo> {
        ids.iter()
            .map(|id| ReplicaInfo {
                id: (*id).into(),
                address: format!("{id}:8080"),
            })
            .collect()
    }

    fn owners(sessions: &[String], live: &[ReplicaInfo]) -> Vec<String> {
        sessions
            .iter()
            .map(|s| owner(s, live).map(|r| r.id.clone()).unwrap_or_default())
            .collect()
    }

    fn sessions(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("session-{i}")).collect()
    }

    #[test]
    fn no_replica_owns_nothing_and_one_owns_everything() {
        assert!(owner("s", &[]).is_none());
        let one = replicas(&["a"]);
        assert!(owners(&sessions(50), &one).iter().all(|o| o == "a"));
    }

    #[test]
    fn the_owner_does_not_depend_on_the_list_order() {
        let forward = replicas(&["a", "b", "c"]);
        let backward = replicas(&["c", "b", "a"]);
        assert_eq!(
            owners(&sessions(200), &forward),
            owners(&sessions(200), &backward)
        );
    }

    #[test]
    fn sessions_spread_over_the_replicas() {
        let live = replicas(&["a", "b", "c", "d"]);
        let all = owners(&sessions(4000), &live);
        for id in ["a", "b", "c", "d"] {
            let share = all.iter().filter(|o| *o == id).count();
            // 1000 expected each; 4 standard deviations is about 110.
            assert!((850..=1150).contains(&share), "{id} owns {share} of 4000");
        }
    }

    #[test]
    fn a_joining_replica_takes_only_its_share() {
        let sessions = sessions(3000);
        let before = owners(&sessions, &replicas(&["a", "b", "c"]));
        let after = owners(&sessions, &replicas(&["a", "b", "c", "d"]));
        let mut moved = 0;
        for (old, new) in before.iter().zip(&after) {
            if old != new {
                assert_eq!(new, "d", "a session moved between two replicas that stayed");
                moved += 1;
            }
        }
        // A quarter of the sessions move to the newcomer, and no more.
        assert!((600..=900).contains(&moved), "{moved} of 3000 moved");
    }

    #[test]
    fn a_leaving_replica_hands_over_only_its_own_sessions() {
        let sessions = sessions(3000);
        let before = owners(&sessions, &replicas(&["a", "b", "c"]));
        let after = owners(&sessions, &replicas(&["a", "c"]));
        for (old, new) in before.iter().zip(&after) {
            if old != "b" {
                assert_eq!(old, new, "a session of a staying replica moved");
            }
        }
    }
}
