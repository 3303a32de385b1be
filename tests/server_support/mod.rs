//! Harness of the server tests: a live server on `127.0.0.1:0` serving the
//! embedded Test model, in its own actix System on its own thread, plus SSE
//! and Prometheus helpers.
//!
//! Each test starts its own server, so counters and slots seen through
//! `/metrics` belong to that test alone.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix_web::dev::ServerHandle;
use serde_json::Value;
use tandem::engine::{Engine, EngineConfig};
use tandem::scheduler::SchedulerConfig;
use tandem::server::{self, AppState, ChatTemplate, HttpConfig, ListenConfig, ShutdownOutcome};
use tandem::tiny::{tiny_model_cpu, TinyPreset};
use tandem::TandemHandle;

/// Context length of the Test preset.
pub const TEST_CONTEXT: usize = 1024;

/// How to start a test server.
#[derive(Clone)]
pub struct Options {
    pub sched: SchedulerConfig,
    pub http: HttpConfig,
    /// Load the model and mark the server ready (false: stays `loading`).
    pub ready: bool,
    /// A chat template to give the (template-less) embedded tokenizer.
    pub chat_template: Option<String>,
    /// What the server serves.
    pub model: TestModel,
}

/// The model a test server serves.
#[derive(Clone, Debug, Default)]
pub enum TestModel {
    /// The embedded Test preset.
    #[default]
    Tiny,
    /// A Hugging Face folder or a GGUF file (its quantised weights kept).
    Path(std::path::PathBuf),
}

impl TestModel {
    fn load(&self) -> (tandem::model::Model, tandem::tokenizer::Tokenizer, String) {
        let path = match self {
            TestModel::Tiny => {
                let (m, t) = tiny_model_cpu(TinyPreset::Test).expect("tiny model");
                return (m, t, TinyPreset::Test.name().into());
            }
            TestModel::Path(p) => p,
        };
        let opts = tandem::model::LoadOptions {
            weight_format: tandem::model::WeightFormat::AsStored,
            ..Default::default()
        };
        let name = path.display().to_string();
        if tandem::gguf::is_gguf_path(path) {
            let file = tandem::gguf::GgufFile::open(path).expect("GGUF");
            let tokenizer = tandem::tokenizer::Tokenizer::from_gguf(&file).expect("tokenizer");
            (
                tandem::gguf::load_model(&file, &opts).expect("model"),
                tokenizer,
                name,
            )
        } else {
            let tokenizer = tandem::tokenizer::Tokenizer::from_dir(path).expect("tokenizer");
            (
                tandem::model::Model::from_dir(path, &opts).expect("model"),
                tokenizer,
                name,
            )
        }
    }
}

impl Default for Options {
    fn default() -> Self {
        Self {
            sched: SchedulerConfig::default(),
            http: HttpConfig::default(),
            ready: true,
            chat_template: None,
            model: TestModel::Tiny,
        }
    }
}

/// A running server.
pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<AppState>,
    /// The scheduler behind the server (None when not ready), for library
    /// comparisons against the very same model.
    pub handle: Option<TandemHandle>,
    http: ServerHandle,
    system: actix_web::rt::System,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TestServer {
    pub fn start(opts: Options) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let system = actix_web::rt::System::new();
            system.block_on(async move {
                let state = AppState::new(opts.http.clone());
                let mut handle = None;
                if opts.ready {
                    let (model, tokenizer, model_name) = opts.model.load();
                    let tokenizer = match opts.chat_template.clone() {
                        Some(t) => tokenizer.with_chat_template(Some(t)),
                        None => tokenizer,
                    };
                    let template = ChatTemplate::from_tokenizer(&tokenizer).expect("template");
                    let engine = Engine::new(
                        model,
                        EngineConfig {
                            kv_capacity_tokens: 256 * 1024,
                            model_name,
                            eos_ids: tokenizer.eos_ids().to_vec(),
                            ..Default::default()
                        },
                    );
                    let h = TandemHandle::start(engine, tokenizer, opts.sched.clone())
                        .expect("scheduler");
                    state.set_ready(h.clone(), template);
                    handle = Some(h);
                }
                let listen = ListenConfig {
                    port: 0,
                    workers: 2,
                    shutdown_timeout: Duration::from_secs(2),
                    ..ListenConfig::default()
                };
                let (http, addr) = server::bind(state.clone(), &listen).expect("bind");
                let http_handle = http.handle();
                actix_web::rt::spawn(http);
                tx.send((
                    addr,
                    state,
                    handle,
                    http_handle,
                    actix_web::rt::System::current(),
                ))
                .expect("send");
            });
            system.run().ok();
        });
        let (addr, state, handle, http, system) = rx.recv().expect("server thread started");
        Self {
            addr,
            state,
            handle,
            http,
            system,
            thread: Some(thread),
        }
    }

    pub fn ready() -> Self {
        Self::start(Options::default())
    }

    pub fn handle(&self) -> &TandemHandle {
        self.handle.as_ref().expect("a ready server")
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Graceful shutdown, as on SIGTERM.
    pub async fn shutdown(&self, drain: Duration) -> ShutdownOutcome {
        server::shutdown_gracefully(&self.state, &self.http, drain).await
    }

    /// Parsed `/metrics`.
    pub async fn metrics(&self, client: &reqwest::Client) -> Metrics {
        let text = client
            .get(self.url("/metrics"))
            .send()
            .await
            .expect("GET /metrics")
            .text()
            .await
            .expect("metrics body");
        Metrics::parse(&text)
    }

    /// Polls `/metrics` until `pred` holds or `timeout` passes.
    pub async fn wait_metrics(
        &self,
        client: &reqwest::Client,
        timeout: Duration,
        pred: impl Fn(&Metrics) -> bool,
    ) -> Metrics {
        let t0 = Instant::now();
        loop {
            let m = self.metrics(client).await;
            if pred(&m) || t0.elapsed() > timeout {
                return m;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        drop(self.http.stop(false));
        self.system.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `/metrics` parsed with `prometheus-parse`: value by name and labels.
pub struct Metrics {
    pub samples: Vec<prometheus_parse::Sample>,
    pub docs: HashMap<String, String>,
}

impl Metrics {
    pub fn parse(text: &str) -> Self {
        let lines = text.lines().map(|l| Ok(l.to_string()));
        let scrape = prometheus_parse::Scrape::parse(lines).expect("valid Prometheus text");
        Self {
            samples: scrape.samples,
            docs: scrape.docs,
        }
    }

    /// A counter or gauge; `labels` must all match.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .and_then(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => Some(v),
                _ => None,
            })
    }

    pub fn get(&self, name: &str) -> f64 {
        self.value(name, &[])
            .unwrap_or_else(|| panic!("metric {name} missing"))
    }

    pub fn outcome(&self, outcome: &str) -> f64 {
        self.value("tandem_requests_total", &[("outcome", outcome)])
            .expect("tandem_requests_total")
    }

    /// A histogram's sample count.
    pub fn histogram_count(&self, name: &str) -> u64 {
        self.samples
            .iter()
            .find(|s| s.metric == name)
            .and_then(|s| match &s.value {
                prometheus_parse::Value::Histogram(buckets) => {
                    buckets.iter().map(|b| b.count as u64).max()
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("histogram {name} missing"))
    }
}

/// The `data:` payloads of an SSE body, in order.
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|e| e.trim().strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// The JSON chunks of an SSE body, asserting it ends with `[DONE]`.
pub fn sse_chunks(body: &str) -> Vec<Value> {
    let events = sse_events(body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk JSON"))
        .collect()
}

/// POSTs JSON and returns (status, body JSON).
pub async fn post_json(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = client.post(url).json(body).send().await.expect("POST");
    let status = r.status().as_u16();
    let text = r.text().await.expect("body");
    let v = serde_json::from_str(&text).unwrap_or_else(|_| panic!("JSON body, got {text}"));
    (status, v)
}

/// POSTs a streaming request and returns the whole SSE body.
pub async fn post_stream(client: &reqwest::Client, url: &str, body: &Value) -> String {
    let r = client.post(url).json(body).send().await.expect("POST");
    assert_eq!(r.status(), 200);
    let ct = r.headers()["content-type"]
        .to_str()
        .unwrap_or_default()
        .to_string();
    assert!(ct.starts_with("text/event-stream"), "{ct}");
    r.text().await.expect("SSE body")
}

/// The real `tandem serve` binary on an ephemeral port, serving the
/// embedded Test model. Killed on drop if still running.
pub struct BinaryServer {
    pub child: std::process::Child,
    pub addr: SocketAddr,
}

impl BinaryServer {
    /// Starts `tandem serve --embedded test --port 0 EXTRA…` and waits for
    /// its `ready` line.
    pub fn spawn(extra: &[&str]) -> Self {
        Self::spawn_logging(extra, "warn", None)
    }

    /// [`spawn`](Self::spawn) with `RUST_LOG=rust_log` and stderr (the
    /// log) written to `log` (discarded when `None`).
    pub fn spawn_logging(extra: &[&str], rust_log: &str, log: Option<&std::path::Path>) -> Self {
        use std::io::BufRead;
        use std::process::{Command, Stdio};
        let stderr = match log {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("create the log file")),
            None => Stdio::null(),
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_tandem"))
            .args(["serve", "--embedded", "test", "--port", "0"])
            .args(extra)
            .env("RUST_LOG", rust_log)
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawn tandem");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut addr = None;
        loop {
            let line = rx
                .recv_timeout(Duration::from_secs(60))
                .expect("tandem serve printed `ready` in time");
            if let Some(a) = line.strip_prefix("listening on http://") {
                addr = Some(a.parse().expect("address"));
            }
            if line == "ready" {
                break;
            }
        }
        Self {
            child,
            addr: addr.expect("a `listening on` line before `ready`"),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Sends a signal (`TERM`, `INT`) with `kill`.
    pub fn signal(&self, name: &str) {
        let ok = std::process::Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.child.id().to_string())
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{name}");
    }

    /// Waits for the process to exit; `None` after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let t0 = Instant::now();
        while t0.elapsed() < timeout {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for BinaryServer {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Runs `tandem ARGS…` to completion: (exit code, stderr).
pub fn run_binary(args: &[&str]) -> (Option<i32>, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run tandem");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the Python client `tests/SCRIPT` against `server`'s `/v1` with
/// `args` after the URL; it must exit 0 and print "checks passed".
pub fn run_client_script(server: &BinaryServer, script: &str, args: &[&str]) {
    let path = format!("{}/tests/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3")
        .arg(&path)
        .arg(server.url("/v1"))
        .args(args)
        .output()
        .expect("run python3");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "{script} {args:?} failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("checks passed"), "{stdout}");
}
