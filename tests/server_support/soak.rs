//! The project's own bounded soak (issue #20): concurrent clients on the
//! embedded Test model with random cancellations of both kinds (FIN and
//! RST), malformed requests and overload (a small queue), for a bounded
//! number of rounds and seconds. It asserts that no answer is a 5xx, that
//! every complete answer has each of its events once (one finish reason,
//! one `[DONE]`, as many tokens as `usage` says), and that at the end no
//! slot, queue entry or KV reservation is left and `/metrics` is idle.
//!
//! `TANDEM_SOAK_SECS` lengthens it (default: 60 rounds per client within 30 s; the rounds bound it too,
//! unless the variable is set).

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::hardening::{raw_exchange, raw_post};
use super::*;

/// What the clients saw, summed.
#[derive(Default)]
struct Tally {
    complete: AtomicU64,
    streamed: AtomicU64,
    dropped_streams: AtomicU64,
    fin_closed: AtomicU64,
    rst_closed: AtomicU64,
    malformed: AtomicU64,
    overloaded: AtomicU64,
}

fn bump(n: &AtomicU64) {
    n.fetch_add(1, Ordering::Relaxed);
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Closes a socket with an RST instead of a FIN (SO_LINGER 0).
fn close_with_reset(sock: TcpStream) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: a valid socket and a correctly sized option value.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&linger as *const libc::linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            );
        }
    }
    drop(sock);
}

/// A whole completion, checked: exactly the events it should have.
fn check_whole(v: &Value) {
    let choice = &v["choices"][0];
    let reason = choice["finish_reason"].as_str().expect("a finish reason");
    assert!(["length", "stop"].contains(&reason), "{v}");
    let tokens = choice["logprobs"]["tokens"].as_array().expect("logprobs");
    assert_eq!(
        tokens.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, choice["text"].as_str().unwrap(), "{v}");
}

/// A whole stream, checked: one finish reason, last; usage after it; one
/// `[DONE]`, last; as many tokens as usage counts.
fn check_stream(body: &str) {
    let events = sse_events(body);
    assert_eq!(
        events.iter().filter(|e| *e == "[DONE]").count(),
        1,
        "{body}"
    );
    let chunks = sse_chunks(body);
    let finishes: Vec<usize> = chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c["choices"][0]["finish_reason"].is_string())
        .map(|(i, _)| i)
        .collect();
    assert_eq!(finishes.len(), 1, "{body}");
    let (usage, rest) = chunks.split_last().unwrap();
    assert_eq!(
        finishes[0],
        rest.len() - 1,
        "finish reason, then usage: {body}"
    );
    let tokens: usize = rest
        .iter()
        .filter_map(|c| c["choices"][0]["logprobs"]["tokens"].as_array())
        .map(Vec::len)
        .sum();
    assert_eq!(
        tokens as u64,
        usage["usage"]["completion_tokens"].as_u64().unwrap(),
        "{body}"
    );
}

/// Malformed requests: bad JSON, wrong types, a bad head.
fn malformed(rng: &mut Rng) -> Vec<u8> {
    let bodies = [
        r#"{"prompt": "#,
        r#"[1, 2]"#,
        r#"{"prompt": "x", "temperature": "hot"}"#,
        r#"{"prompt": "x", "logit_bias": "x"}"#,
        r#"{"prompt": "x", "max_tokens": -3}"#,
        r#"{"prompt": {"a": 1}}"#,
        r#"{"prompt": "x", "stop": [true, 2]}"#,
        r#"{"prompt": "x", "tandem": {"mtp": 7}}"#,
    ];
    match rng.below(bodies.len() as u64 + 2) as usize {
        i if i < bodies.len() => raw_post("/v1/completions", bodies[i]).into_bytes(),
        i if i == bodies.len() => {
            b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: -1\r\n\r\n".to_vec()
        }
        _ => b"GET /x HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\n\r\n".to_vec(),
    }
}

async fn client_loop(
    s: Arc<TestServer>,
    seed: u64,
    rounds: usize,
    until: Instant,
    tally: Arc<Tally>,
) {
    let c = client();
    let mut rng = Rng(seed | 1);
    let url = s.url("/v1/completions");
    for round in 0..rounds {
        if Instant::now() > until {
            break;
        }
        let prompt = format!("client {seed} round {round}");
        let max_tokens = 4 + rng.below(60);
        let whole = json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8,
                           "seed": seed, "logprobs": 0});
        match rng.below(10) {
            // A whole answer.
            0..=1 => {
                let r = c.post(&url).json(&whole).send().await.expect("POST");
                let status = r.status().as_u16();
                let v: Value = r.json().await.expect("a JSON body");
                match status {
                    200 => {
                        check_whole(&v);
                        bump(&tally.complete);
                    }
                    429 => bump(&tally.overloaded),
                    other => panic!("{other}: {v}"),
                }
            }
            // A whole stream.
            2..=3 => {
                let mut body = whole.clone();
                body["stream"] = json!(true);
                body["stream_options"] = json!({"include_usage": true});
                let r = c.post(&url).json(&body).send().await.expect("POST");
                match r.status().as_u16() {
                    200 => {
                        check_stream(&r.text().await.expect("SSE body"));
                        bump(&tally.streamed);
                    }
                    429 => bump(&tally.overloaded),
                    other => panic!("{other}: {}", r.text().await.unwrap_or_default()),
                }
            }
            // A stream dropped after its first chunk.
            4..=5 => {
                let mut body = whole.clone();
                body["stream"] = json!(true);
                body["max_tokens"] = json!(500);
                let mut r = c.post(&url).json(&body).send().await.expect("POST");
                match r.status().as_u16() {
                    200 => {
                        let _ = r.chunk().await;
                        drop(r);
                        bump(&tally.dropped_streams);
                    }
                    429 => bump(&tally.overloaded),
                    other => panic!("{other}"),
                }
            }
            // A whole answer abandoned: FIN or RST after a short wait.
            6..=7 => {
                let body = json!({"prompt": prompt, "max_tokens": 500}).to_string();
                let mut sock = TcpStream::connect(s.addr).expect("connect");
                sock.write_all(raw_post("/v1/completions", &body).as_bytes())
                    .expect("write");
                tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                if rng.below(2) == 0 {
                    drop(sock);
                    bump(&tally.fin_closed);
                } else {
                    close_with_reset(sock);
                    bump(&tally.rst_closed);
                }
            }
            // Malformed.
            _ => {
                let request = malformed(&mut rng);
                let addr = s.addr;
                let (status, _, body, _) = tokio::task::spawn_blocking(move || {
                    raw_exchange(addr, &request, Duration::from_secs(10))
                })
                .await
                .unwrap();
                assert!((400..500).contains(&status), "{status}: {body}");
                let v: Value = serde_json::from_str(&body).expect("a JSON error");
                assert!(v["error"]["message"].is_string(), "{v}");
                bump(&tally.malformed);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_with_cancellations_malformed_requests_and_overload() {
    let secs: Option<u64> = std::env::var("TANDEM_SOAK_SECS")
        .ok()
        .and_then(|v| v.parse().ok());
    let (rounds, until) = match secs {
        Some(s) => (usize::MAX, Instant::now() + Duration::from_secs(s)),
        None => (60, Instant::now() + Duration::from_secs(30)),
    };
    let s = Arc::new(TestServer::start(Options {
        // Few slots and a short queue: 24 clients overload it.
        sched: SchedulerConfig {
            max_seqs: 6,
            max_queue: 6,
            step_token_budget: 64,
            max_prefill_chunk: 32,
            prefix_caching: true,
        },
        ..Options::default()
    }));
    let tally = Arc::new(Tally::default());
    let clients: Vec<_> = (0..24u64)
        .map(|i| {
            tokio::spawn(client_loop(
                s.clone(),
                0x5eed_0000 + i * 7919,
                rounds,
                until,
                tally.clone(),
            ))
        })
        .collect();
    for c in clients {
        c.await.expect("a client panicked");
    }
    let c = client();
    let m = s
        .wait_metrics(&c, Duration::from_secs(10), |m| {
            m.get("tandem_running_sequences") == 0.0
                && m.get("tandem_queue_depth") == 0.0
                && m.get("tandem_releasing_sequences") == 0.0
        })
        .await;
    let t = |n: &AtomicU64| n.load(Ordering::Relaxed);
    eprintln!(
        "soak: {} whole, {} streamed, {} streams dropped, {} FIN / {} RST abandoned, {} malformed, {} overloaded",
        t(&tally.complete),
        t(&tally.streamed),
        t(&tally.dropped_streams),
        t(&tally.fin_closed),
        t(&tally.rst_closed),
        t(&tally.malformed),
        t(&tally.overloaded)
    );
    assert_eq!(m.get("tandem_running_sequences"), 0.0, "no sequence left");
    assert_eq!(m.get("tandem_queue_depth"), 0.0, "no queue entry left");
    assert_eq!(m.get("tandem_releasing_sequences"), 0.0);
    assert_eq!(
        m.get("tandem_free_slots"),
        m.get("tandem_max_sequences"),
        "no leaked slot"
    );
    assert_eq!(
        m.get("tandem_kv_reserved_tokens"),
        0.0,
        "no leaked KV reservation"
    );
    assert_eq!(m.get("tandem_kv_blocks_used"), 0.0, "no block owned");
    assert!(m.get("tandem_kv_blocks_total") > 0.0);
    assert!(m.get("tandem_kv_blocks_cached") <= m.get("tandem_kv_blocks_total"));
    assert!(
        m.get("tandem_prefix_cache_hit_tokens_total")
            <= m.get("tandem_prefix_cache_query_tokens_total")
    );
    assert_eq!(m.get("tandem_preempted_sequences"), 0.0);
    assert_eq!(m.outcome("failed"), 0.0);
    // Every accepted request ended exactly once.
    assert_eq!(
        m.get("tandem_requests_submitted_total"),
        m.outcome("finished") + m.outcome("cancelled"),
        "submitted = finished + cancelled"
    );
    let completed = t(&tally.complete) + t(&tally.streamed);
    assert!(m.outcome("finished") >= completed as f64);
    assert!(completed > 0 && t(&tally.malformed) > 0, "the mix ran");
    // Abandoned whole requests did not run to their 500 tokens.
    let abandoned = t(&tally.fin_closed) + t(&tally.rst_closed) + t(&tally.dropped_streams);
    assert!(
        m.get("tandem_generated_tokens_total") < (completed * 64 + abandoned * 250) as f64,
        "abandoned requests were cancelled"
    );
    // No 5xx anywhere.
    for sample in &m.samples {
        if sample.metric == "tandem_http_responses_total" {
            let code = sample.labels.get("code").unwrap_or("0");
            assert!(!code.starts_with('5'), "a {code} answer");
        }
    }
    // Idle: two scrapes a little apart see no step.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let later = s.metrics(&c).await;
    assert_eq!(
        later.get("tandem_steps_total"),
        m.get("tandem_steps_total"),
        "idle"
    );
}
