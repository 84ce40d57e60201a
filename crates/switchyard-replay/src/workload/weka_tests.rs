use super::*;

fn call(t: f64, api: f64, ids: &[u32], out: u64) -> WekaCall {
    WekaCall {
        t,
        input: ids.len() as u64 * 4,
        output: out,
        hash_ids: ids.to_vec(),
        api_time: api,
    }
}

fn trace(entries: Vec<WekaEntry>) -> WekaTrace {
    WekaTrace {
        id: "t".into(),
        block_size: 4,
        entries,
    }
}

/// Drives a workload with a fixed service time per request, returning the log.
fn drive(workload: &mut WekaWorkload, service: Micros) -> Vec<CallLog> {
    let mut out = Outbox::default();
    workload.start(&mut out);
    let mut queue: Vec<(Micros, u64)> = Vec::new();
    loop {
        for (at, spec) in out.drain() {
            queue.push((at + service, spec.id));
        }
        queue.sort_by(|a, b| b.cmp(a));
        let Some((done, id)) = queue.pop() else {
            break;
        };
        workload.on_finished(id, true, done, &mut out);
    }
    workload.log().to_vec()
}

#[test]
fn parent_calls_wait_for_completion_plus_the_scaled_gap() {
    let t = trace(vec![
        WekaEntry::Call(call(0.0, 1.0, &[1], 1)),
        WekaEntry::Call(call(11.0, 1.0, &[1, 2], 1)),
    ]);
    let config = WekaConfig {
        time_scale: 0.5,
        ..WekaConfig::default()
    };
    let mut w = WekaWorkload::new(vec![t], config).unwrap();
    let log = drive(&mut w, 2_000_000);
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].sent_at, 0);
    // Recorded gap 11 - (0 + 1) = 10 s, scaled by 0.5, after the actual completion at 2 s.
    assert_eq!(log[1].sent_at, 2_000_000 + 5_000_000);
    assert_eq!(w.sessions_completed(), 1);
}

#[test]
fn gaps_are_capped() {
    let t = trace(vec![
        WekaEntry::Call(call(0.0, 0.0, &[1], 1)),
        WekaEntry::Call(call(10_000.0, 0.0, &[1], 1)),
    ]);
    let config = WekaConfig {
        max_gap_s: 3.0,
        ..WekaConfig::default()
    };
    let log = drive(&mut WekaWorkload::new(vec![t], config).unwrap(), 0);
    assert_eq!(log[1].sent_at, 3_000_000);
}

#[test]
fn async_subagents_do_not_gate_the_parent_but_gate_the_session() {
    let sub = WekaSubagent {
        t: 1.0,
        agent_id: "bg".into(),
        is_async: true,
        calls: vec![call(0.0, 50.0, &[9], 1)],
    };
    let t = trace(vec![
        WekaEntry::Call(call(0.0, 1.0, &[1], 1)),
        WekaEntry::Subagent(sub),
        WekaEntry::Call(call(2.0, 1.0, &[1, 2], 1)),
    ]);
    let config = WekaConfig {
        concurrency: 1,
        sessions: Some(2),
        ..WekaConfig::default()
    };
    let mut w = WekaWorkload::new(vec![t], config).unwrap();
    // The subagent call takes 100 s; the parent call only 1 s.
    let mut out = Outbox::default();
    w.start(&mut out);
    let first: Vec<_> = out.drain().collect();
    assert_eq!(first.len(), 1);
    w.on_finished(first[0].1.id, true, 1_000_000, &mut out);
    let next: Vec<_> = out.drain().collect();
    // Subagent launched and the next parent call sent without waiting for it.
    assert_eq!(next.len(), 2);
    let parent = next
        .iter()
        .find(|(_, s)| w.log()[s.id as usize].subagent.is_none())
        .unwrap();
    let sub = next
        .iter()
        .find(|(_, s)| w.log()[s.id as usize].subagent.is_some())
        .unwrap();
    w.on_finished(parent.1.id, true, 3_000_000, &mut out);
    assert!(
        out.is_empty(),
        "the session waits for its background subagent"
    );
    assert_eq!(w.sessions_completed(), 0);
    w.on_finished(sub.1.id, true, 100_000_000, &mut out);
    assert_eq!(w.sessions_completed(), 1);
    // The lane drew the next session, with its own namespace.
    let drawn: Vec<_> = out.drain().collect();
    assert_eq!(drawn.len(), 1);
    assert_eq!(drawn[0].0, 100_000_000);
    assert_ne!(drawn[0].1.prompt.namespace, first[0].1.prompt.namespace);
}

#[test]
fn lanes_replace_finished_sessions_until_every_trace_ran() {
    let traces: Vec<WekaTrace> = (0..5)
        .map(|i| WekaTrace {
            id: format!("t{i}"),
            ..trace(vec![WekaEntry::Call(call(0.0, 0.0, &[1], 1))])
        })
        .collect();
    let config = WekaConfig {
        concurrency: 2,
        ..WekaConfig::default()
    };
    let mut w = WekaWorkload::new(traces, config).unwrap();
    assert_eq!(w.expected_requests(), Some(5));
    let log = drive(&mut w, 1_000);
    assert_eq!(log.len(), 5);
    assert_eq!(w.sessions_completed(), 5);
    let starts: Vec<Micros> = log.iter().map(|l| l.sent_at).collect();
    assert_eq!(starts, vec![0, 0, 1_000, 1_000, 2_000]);
}
