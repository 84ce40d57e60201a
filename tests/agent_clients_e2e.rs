//! Real agent clients, unmodified, through the gateway: Claude Code (`/v1/messages`) and Codex
//! CLI (`/v1/responses`) at the versions pinned in `tests/agents/package.json` (installed by
//! `tests/agents/fetch.sh`, which the test command runs).
//!
//! * `switchyard up` exactly as the README starts it answers both clients' first turns with a
//!   normal answer; a resumed turn of each session lands on the worker of the first, and the
//!   session ids the clients send are the sessions in `/admin/decisions`.
//! * In front of the vLLM and the SGLang stand-in engines scripted with a tool call in the
//!   model's native format and a final answer, each client runs its whole tool loop: the gateway
//!   parses the call, the client runs it locally (a shell command writing a file), sends the
//!   result back, and ends with the scripted answer.

#![allow(clippy::unwrap_used, clippy::expect_used)] // test code: a panic is a failure report

use crate::support;

use std::path::{Path, PathBuf};
use std::process::{Output, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use support::Launch;
use support::fake_engine::{Fake, indexed};
use switchyard_testkit::EtcdServer;

/// Where `tests/agents/fetch.sh` installed the clients.
fn clients() -> PathBuf {
    let dir = std::env::var_os("SWITCHYARD_AGENT_CLIENTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                .join(".cache/switchyard/agent-clients")
        });
    let bin = dir.join("node_modules/.bin");
    assert!(
        bin.join("claude").exists() && bin.join("codex").exists(),
        "the agent clients are missing in {}: run tests/agents/fetch.sh",
        dir.display()
    );
    bin
}

/// Runs an agent client with a clean environment of its own (no host credentials or settings),
/// bounded in time.
async fn run(program: &Path, args: &[&str], cwd: &Path, env: &[(&str, &str)]) -> Output {
    let mut command = tokio::process::Command::new(program);
    command
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("LANG", "C.UTF-8")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    tokio::time::timeout(Duration::from_secs(240), command.output())
        .await
        .unwrap_or_else(|_| panic!("{} {args:?} finished within 240 s", program.display()))
        .expect("run the agent client")
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// A client's home, working folder and, for Codex, its provider configuration pointing at the
/// gateway's `/v1` (Codex's own custom-provider form, `wire_api = "responses"`).
struct Workspace {
    _dir: tempfile::TempDir,
    home: PathBuf,
    cwd: PathBuf,
}

impl Workspace {
    fn new(api: &str, model: &str) -> Workspace {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        let cwd = dir.path().join("work");
        std::fs::create_dir_all(home.join(".codex")).unwrap();
        std::fs::create_dir_all(&cwd).unwrap();
        std::fs::write(
            home.join(".codex/config.toml"),
            format!(
                "model = \"{model}\"\nmodel_provider = \"switchyard\"\n\n\
                 [model_providers.switchyard]\nname = \"Switchyard\"\n\
                 base_url = \"{api}/v1\"\nwire_api = \"responses\"\nenv_key = \"SWITCHYARD_KEY\"\n"
            ),
        )
        .unwrap();
        Workspace {
            _dir: dir,
            home,
            cwd,
        }
    }

    /// `claude -p <prompt> --output-format json` (plus `extra`), its JSON result.
    async fn claude(&self, api: &str, model: &str, prompt: &str, extra: &[&str]) -> Value {
        let mut args = vec!["-p", prompt, "--model", model, "--output-format", "json"];
        args.extend_from_slice(extra);
        let home = self.home.to_str().unwrap();
        let output = run(
            &clients().join("claude"),
            &args,
            &self.cwd,
            &[
                ("HOME", home),
                ("ANTHROPIC_BASE_URL", api),
                ("ANTHROPIC_API_KEY", "sk-test"),
            ],
        )
        .await;
        assert!(output.status.success(), "claude: {}", text(&output));
        let result: Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|e| panic!("claude's JSON result ({e}): {}", text(&output)));
        assert_eq!(result["is_error"], false, "{result}");
        result
    }

    /// `codex exec <args>` (non-interactive), its output.
    async fn codex(&self, args: &[&str]) -> Output {
        let home = self.home.to_str().unwrap();
        let codex_home = self.home.join(".codex");
        let mut all = vec![
            "exec",
            "--skip-git-repo-check",
            "--dangerously-bypass-approvals-and-sandbox",
        ];
        all.extend_from_slice(args);
        let output = run(
            &clients().join("codex"),
            &all,
            &self.cwd,
            &[
                ("HOME", home),
                ("CODEX_HOME", codex_home.to_str().unwrap()),
                ("SWITCHYARD_KEY", "sk-test"),
            ],
        )
        .await;
        assert!(output.status.success(), "codex: {}", text(&output));
        // Codex reports a failed turn on stderr as `ERROR: …` (the simulated answer on stdout is
        // random text, which may hold the word).
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.lines().any(|l| l.starts_with("ERROR")),
            "codex reported an error: {}",
            text(&output)
        );
        output
    }
}

/// The decisions logged for `session`, oldest first.
async fn decisions(api: &str, session: &str) -> Vec<Value> {
    let url = format!("{api}/admin/decisions?session={session}&limit=100");
    let body: Value = reqwest::get(url).await.unwrap().json().await.unwrap();
    let mut list = match body {
        Value::Array(list) => list,
        other => other["decisions"].as_array().cloned().unwrap_or_default(),
    };
    list.sort_by_key(|d| d["id"].as_u64());
    list
}

/// The one session and its source a client's decisions carry, and the workers they went to.
fn session_of(decisions: &[Value]) -> (String, String, Vec<String>) {
    let first = decisions
        .first()
        .expect("the client's requests were routed");
    let session = first["session"].as_str().unwrap().to_owned();
    let source = first["session_source"].as_str().unwrap().to_owned();
    let workers = decisions
        .iter()
        .map(|d| d["worker"].as_str().unwrap().to_owned())
        .collect();
    (session, source, workers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_and_codex_run_on_switchyard_up_as_the_readme_starts_it() {
    let up = Launch::up_as_readme(4).start().await;
    let api = format!("http://{}", up.address);
    let ws = Workspace::new(&api, "sim-8b");

    // Claude Code: a normal answer that ends its turn, then the same session resumed.
    let first = ws.claude(&api, "sim-8b", "Say hello", &[]).await;
    assert_eq!(first["stop_reason"], "end_turn", "{first}");
    // The simulated model's text is random (it may even end at once): a string, however long.
    assert!(first["result"].is_string(), "{first}");
    let session = first["session_id"].as_str().unwrap().to_owned();
    let again = ws
        .claude(&api, "sim-8b", "Say it again", &["--resume", &session])
        .await;
    assert_eq!(again["session_id"], session.as_str(), "{again}");
    let logged = decisions(&api, &session).await;
    assert!(logged.len() >= 2, "both turns logged: {logged:?}");
    let (named, source, workers) = session_of(&logged);
    assert_eq!(named, session);
    assert_eq!(source, "x-claude-code-session-id");
    assert!(
        workers.iter().all(|w| *w == workers[0]),
        "one session, one worker: {workers:?}"
    );
    let ignored = logged[0]["ignored_fields"].to_string();
    assert!(
        ignored.contains("anthropic-beta:claude-code-20250219"),
        "{ignored}"
    );

    // Codex: a normal answer; the resumed thread keeps its worker too.
    ws.codex(&["Say hello"]).await;
    ws.codex(&["resume", "--last", "Say it again"]).await;
    let all: Value = reqwest::get(format!("{api}/admin/decisions?limit=100"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let codex_session = all
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["session_source"] == "session-id")
        .expect("Codex's session-id header names its session")["session"]
        .as_str()
        .unwrap()
        .to_owned();
    let logged = decisions(&api, &codex_session).await;
    assert!(logged.len() >= 2, "both turns logged: {logged:?}");
    let (_, _, workers) = session_of(&logged);
    assert!(
        workers.iter().all(|w| *w == workers[0]),
        "one session, one worker: {workers:?}"
    );
    let ignored = logged[0]["ignored_fields"].to_string();
    assert!(ignored.contains("client_metadata"), "{ignored}");
}

/// Scripts the stand-in's next answers: each text, tokenized by the gateway's own tokenizer.
async fn script(api: &str, fake: &Fake, answers: &[&str]) {
    let http = reqwest::Client::new();
    for answer in answers {
        let tokens: Value = http
            .post(format!("{api}/tokenize"))
            .json(&json!({"model": "fake-model", "prompt": answer}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        fake.admin("script", json!({"tokens": tokens["tokens"]}))
            .await;
    }
}

/// A Hermes tool call (the built-in template's format), as the model writes it.
fn tool_call(name: &str, arguments: Value) -> String {
    format!(
        "<tool_call>\n{}\n</tool_call>",
        json!({"name": name, "arguments": arguments})
    )
}

async fn tool_loops_in_front_of(flavor: &str) {
    let etcd = EtcdServer::start().expect("etcd");
    let endpoint = etcd.endpoint();
    let cluster = format!("agents-{flavor}-{}", std::process::id());
    // Agent prompts run to tens of thousands of tokens and ask for 32,000 more.
    let fake = Fake::start(&[
        "--flavor",
        flavor,
        "--max-model-len",
        "131072",
        "--block-size",
        "16",
        "--num-blocks",
        "16384",
    ])
    .await;
    let _worker = fake
        .worker(flavor, "engine-a", &endpoint, &cluster)
        .start()
        .await;
    let gateway = Launch::gateway(&endpoint, &cluster).start().await;
    let api = format!("http://{}", gateway.address);
    assert!(
        support::eventually(Duration::from_secs(15), || async {
            indexed(&api, "engine-a").await.is_some()
        })
        .await
    );
    let ws = Workspace::new(&api, "fake-model");

    // Claude Code: Bash runs the command, the result goes back, the answer ends the loop.
    let call = tool_call(
        "Bash",
        json!({"command": "echo claude-was-here > claude.txt", "description": "Write a file"}),
    );
    script(&api, &fake, &[&call, "Done: claude.txt is written."]).await;
    let result = ws
        .claude(
            &api,
            "fake-model",
            "Write claude.txt",
            &["--allowedTools", "Bash"],
        )
        .await;
    assert_eq!(
        std::fs::read_to_string(ws.cwd.join("claude.txt")).unwrap(),
        "claude-was-here\n"
    );
    assert_eq!(result["result"], "Done: claude.txt is written.", "{result}");
    assert_eq!(result["num_turns"], 2, "{result}");
    // The second turn resent the first: its prompt came from the engine's prefix cache.
    assert!(
        result["usage"]["cache_read_input_tokens"].as_u64().unwrap() > 1000,
        "{result}"
    );

    // Codex: exec_command runs the command, the output goes back as function_call_output.
    let call = tool_call(
        "exec_command",
        json!({"cmd": "echo codex-was-here > codex.txt"}),
    );
    script(&api, &fake, &[&call, "Done: codex.txt is written."]).await;
    let output = ws.codex(&["Write codex.txt"]).await;
    assert_eq!(
        std::fs::read_to_string(ws.cwd.join("codex.txt")).unwrap(),
        "codex-was-here\n"
    );
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("Done: codex.txt is written."),
        "{}",
        text(&output)
    );
    reasoning_switches_reach_the_engine(&endpoint, &cluster, &fake).await;
}

/// `chat_template_kwargs`, `reasoning_effort` and Anthropic's `thinking: disabled` change the
/// tokens the engine receives exactly as the model's template renders the switch: a gateway
/// with Qwen3's tokenizer and template in front of the same engine sends the prompt `/tokenize`
/// renders with `enable_thinking: false`, not the default one.
async fn reasoning_switches_reach_the_engine(etcd: &str, cluster: &str, fake: &Fake) {
    let gateway = Launch::gateway(etcd, cluster)
        .arg(
            "--model-tokenizer",
            &format!("fake-model={}", support::qwen3_dir()),
        )
        .start()
        .await;
    let api = format!("http://{}", gateway.address);
    let http = reqwest::Client::new();
    let messages = json!([{"role": "user", "content": "Is 97 prime?"}]);
    let tokenize = |kwargs: Value| {
        let body =
            json!({"model": "fake-model", "messages": messages, "chat_template_kwargs": kwargs});
        let request = http.post(format!("{api}/tokenize")).json(&body);
        async move {
            let answer: Value = request.send().await.unwrap().json().await.unwrap();
            answer["tokens"].clone()
        }
    };
    let thinking = tokenize(json!({})).await;
    let not_thinking = tokenize(json!({"enable_thinking": false})).await;
    assert_ne!(thinking, not_thinking);
    let sent = || async {
        let requests = fake.admin("requests", json!({})).await;
        let last = requests["requests"]
            .as_array()
            .unwrap()
            .last()
            .unwrap()
            .clone();
        last.get("prompt")
            .or(last.get("input_ids"))
            .unwrap()
            .clone()
    };
    for (path, body, expected) in [
        (
            "/v1/chat/completions",
            json!({"messages": messages, "chat_template_kwargs": {"enable_thinking": false}}),
            &not_thinking,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "reasoning_effort": "none"}),
            &not_thinking,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "reasoning_effort": "high"}),
            &thinking,
        ),
        (
            "/v1/messages",
            json!({"messages": messages, "thinking": {"type": "disabled"}}),
            &not_thinking,
        ),
        (
            "/v1/responses",
            json!({"input": "Is 97 prime?", "reasoning": {"effort": "none"}}),
            &not_thinking,
        ),
    ] {
        let mut body = body;
        body["model"] = json!("fake-model");
        body[if path == "/v1/responses" {
            "max_output_tokens"
        } else {
            "max_tokens"
        }] = json!(4);
        let response = http
            .post(format!("{api}{path}"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.status(),
            200,
            "{path} {body}: {}",
            response.text().await.unwrap()
        );
        assert_eq!(&sent().await, expected, "{path} {body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_and_codex_run_their_tool_loops_in_front_of_vllm() {
    tool_loops_in_front_of("vllm").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claude_code_and_codex_run_their_tool_loops_in_front_of_sglang() {
    tool_loops_in_front_of("sglang").await;
}
