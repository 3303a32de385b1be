//! What a hostile test of `tandem serve` found (issue #20), one test each:
//! abandoned whole requests, malformed heads, slow bodies, wrong-typed
//! fields, `GET /v1/models/{id}`, auth headers, and text == tokens.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use super::*;

/// A POST with a JSON body, as raw bytes (`Connection: close`).
pub fn raw_post(path: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// Sends `request` on a fresh connection and reads until the server closes
/// it (or `timeout`): (status, head, body, whether it closed).
pub fn raw_exchange(
    addr: std::net::SocketAddr,
    request: &[u8],
    timeout: Duration,
) -> (u16, String, String, bool) {
    let mut sock = TcpStream::connect(addr).expect("connect");
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    // A server may answer and close before it has read everything.
    let _ = sock.write_all(request);
    read_response(&mut sock, timeout)
}

/// Reads a response until EOF or `timeout`: (status, head, body, closed).
pub fn read_response(sock: &mut TcpStream, timeout: Duration) -> (u16, String, String, bool) {
    let t0 = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let mut closed = false;
    while t0.elapsed() < timeout {
        match sock.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => {
                closed = true;
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&got).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string(), closed)
}

/// Defect 1: a client that waits for a whole answer and closes its
/// connection normally (FIN) has its sequence cancelled within a step or
/// two, not left generating to `max_tokens`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_requests_whose_client_closed_are_cancelled() {
    let s = TestServer::ready();
    let c = client();
    let body = r#"{"prompt":"x y 1","max_tokens":1000,"temperature":0}"#;
    let socks: Vec<TcpStream> = (0..3)
        .map(|_| {
            let mut sock = TcpStream::connect(s.addr).unwrap();
            sock.write_all(raw_post("/v1/completions", body).as_bytes())
                .unwrap();
            sock
        })
        .collect();
    let m = s
        .wait_metrics(&c, Duration::from_secs(10), |m| {
            m.get("tandem_running_sequences") == 3.0
        })
        .await;
    assert_eq!(
        m.get("tandem_running_sequences"),
        3.0,
        "all three generating"
    );
    drop(socks); // close(): a FIN each, nothing unread
    let t0 = Instant::now();
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0 && m.get("tandem_releasing_sequences") == 0.0
        })
        .await;
    let took = t0.elapsed();
    assert_eq!(m.get("tandem_running_sequences"), 0.0);
    assert!(took < Duration::from_secs(1), "cancelled after {took:?}");
    assert_eq!(m.outcome("cancelled"), 3.0);
    assert_eq!(m.outcome("finished"), 0.0);
    assert_eq!(m.get("tandem_free_slots"), m.get("tandem_max_sequences"));
    assert!(m.get("tandem_generated_tokens_total") < 3000.0);
    // The chat route waits the same way.
    // Greedy: sampled text could reach EOS (random weights) and finish.
    let chat = r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":1000,"temperature":0}"#;
    let mut sock = TcpStream::connect(s.addr).unwrap();
    sock.write_all(raw_post("/v1/chat/completions", chat).as_bytes())
        .unwrap();
    s.wait_metrics(&c, Duration::from_secs(10), |m| {
        m.get("tandem_running_sequences") == 1.0
    })
    .await;
    drop(sock);
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0
        })
        .await;
    assert_eq!(m.outcome("cancelled"), 4.0);
}

/// A body that trickles in, or never arrives in full, is a JSON 408 after
/// the body timeout, and the connection is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_time_out_with_a_json_408() {
    let s = TestServer::start(Options {
        http: HttpConfig {
            body_timeout: Duration::from_millis(300),
            ..HttpConfig::default()
        },
        ..Options::default()
    });
    // Declares 100 bytes, sends 5.
    let head = "POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro";
    let t0 = Instant::now();
    let (status, _, body, closed) = raw_exchange(s.addr, head.as_bytes(), Duration::from_secs(5));
    assert_eq!(status, 408, "{body}");
    assert!(closed, "the connection is closed");
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
    let v: Value = serde_json::from_str(&body).expect("a JSON body");
    assert_eq!(v["error"]["code"], "request_timeout");

    // Chunked, one byte every 50 ms: never done, timed out all the same.
    let mut sock = TcpStream::connect(s.addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    sock.write_all(
        b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
    )
    .unwrap();
    let mut writer = sock.try_clone().unwrap();
    let trickle = std::thread::spawn(move || {
        for _ in 0..100 {
            std::thread::sleep(Duration::from_millis(50));
            if writer.write_all(b"1\r\n \r\n").is_err() {
                break;
            }
        }
    });
    let (status, _, body, closed) = read_response(&mut sock, Duration::from_secs(5));
    assert_eq!(status, 408, "{body}");
    assert!(closed, "the connection is closed");
    let v: Value = serde_json::from_str(&body).expect("a JSON body");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    trickle.join().unwrap();

    // A body that arrives in time is served.
    let ok = raw_post("/v1/completions", r#"{"prompt":"x","max_tokens":2}"#);
    let (status, _, body, _) = raw_exchange(s.addr, ok.as_bytes(), Duration::from_secs(10));
    assert_eq!(status, 200, "{body}");
}

/// Defect 3: wrong-typed `logit_bias` and `tools` are 400s naming the field;
/// well-typed ones that cannot be honoured (an id outside the vocabulary,
/// a parameters schema that does not compile) too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_typed_logit_bias_and_tools_are_named() {
    let s = TestServer::ready();
    let c = client();
    let mut cases = Vec::new();
    for bad in [json!("x"), json!(1), json!(true), json!([1])] {
        cases.push((
            "/v1/completions",
            json!({"prompt": "x", "logit_bias": bad}),
            "logit_bias",
            "invalid_value",
        ));
    }
    cases.push((
        "/v1/completions",
        json!({"prompt": "x", "logit_bias": {"5": "big"}}),
        "logit_bias.5",
        "invalid_value",
    ));
    cases.push((
        "/v1/completions",
        json!({"prompt": "x", "logit_bias": {"99999999": 10}}),
        "logit_bias",
        "invalid_constraint",
    ));
    let chat =
        |tools: Value| json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools});
    for bad in [json!({}), json!({"type": "function"}), json!("x"), json!(1)] {
        cases.push(("/v1/chat/completions", chat(bad), "tools", "invalid_value"));
    }
    cases.push((
        "/v1/chat/completions",
        chat(json!([{"type": "function", "function": {"name": 7}}])),
        "tools[0].function.name",
        "invalid_value",
    ));
    cases.push((
        "/v1/chat/completions",
        chat(json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}])),
        "tools",
        "invalid_request",
    ));
    for (path, body, param, code) in cases {
        let (status, v) = post_json(&c, &s.url(path), &body).await;
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
        assert_eq!(v["error"]["code"], code, "{body}: {v}");
        let root = param.split(['[', '.']).next().unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains(root),
            "{v}"
        );
    }
    // The neutral values are accepted.
    let (status, v) = post_json(
        &c,
        &s.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "tools": [], "logit_bias": {},
                "max_tokens": 2}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
}

/// Defect 4: `GET /v1/models/{id}` answers the model card (or a JSON 404).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_is_retrieved_by_id() {
    let s = TestServer::ready();
    let c = client();
    let r = c
        .get(s.url("/v1/models/tandem-tiny-test"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "model");
    assert_eq!(v["id"], "tandem-tiny-test");
    assert_eq!(v["owned_by"], "tandem");
    for other in ["gpt-4", "a/b", "%FF%FE"] {
        let r = c
            .get(s.url(&format!("/v1/models/{other}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{other}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "model_not_found", "{other}");
        assert_eq!(v["error"]["param"], "model");
    }
}

/// `Bearer` in any case; several `Authorization` headers are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_bearer_scheme_is_case_insensitive_and_one_header_only() {
    let s = TestServer::start(Options {
        http: HttpConfig {
            api_key: Some("k3y".into()),
            ..HttpConfig::default()
        },
        ..Options::default()
    });
    let c = client();
    for auth in ["bearer k3y", "BEARER k3y", "Bearer   k3y"] {
        let r = c
            .get(s.url("/v1/models"))
            .header("authorization", auth)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{auth}");
    }
    let r = c
        .get(s.url("/v1/models"))
        .header("authorization", "Bearer k3y")
        .header("authorization", "Bearer other")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("several"));
    let r = c
        .get(s.url("/v1/models"))
        .header("authorization", "Bearer k3y")
        .header("authorization", "Bearer k3y")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401, "even when both agree");
}

/// Words of the served tokenizer, unknown words, digits and punctuation.
fn random_prompt(rng: &mut u64, vocab: &[String]) -> String {
    let mut next = || {
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        *rng
    };
    let n = 1 + next() % 6;
    let mut words = Vec::new();
    for _ in 0..n {
        let w = match next() % 5 {
            0 => ["x", "y", "1", "42", "zzq"][(next() % 5) as usize].to_string(),
            1 => [".", ",", "!", "?"][(next() % 4) as usize].to_string(),
            _ => vocab[(next() % vocab.len() as u64) as usize].clone(),
        };
        words.push(w);
    }
    words.join(" ")
}

/// Defect 5: over random prompts (known, unknown and punctuation words),
/// the text of a completion is the concatenation of its tokens' texts,
/// whole and streamed, and a word after the prompt keeps its space.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_text_is_the_concatenation_of_its_tokens() {
    text_is_tokens(&TestServer::ready(), 24).await;
}

/// The same on the real tokenizers Tandem ships with its references:
/// stories260k's (SentencePiece-style, byte fallback) and SmolLM2's GGUF
/// one (byte-level BPE). Skips, saying so, without `../shared`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_text_is_the_concatenation_of_its_tokens_on_real_tokenizers() {
    for rel in [
        "models/stories260k",
        "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
    ] {
        let Some(path) = tandem::testing::shared(rel) else {
            continue;
        };
        let s = TestServer::start(Options {
            model: TestModel::Path(path),
            ..Options::default()
        });
        text_is_tokens(&s, 4).await;
    }
}

/// Random prompts (`n` of them, plus the issue's own) through completions,
/// whole, streamed and through the library: the logprobs tokens join to the
/// text, their offsets add up, and usage counts them.
async fn text_is_tokens(s: &TestServer, n: usize) {
    let c = client();
    let tok = s.handle().tokenizer().clone();
    let vocab: Vec<String> = (9..200)
        .filter_map(|id| tok.token_text(id).ok())
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    // The issue's own example first.
    let mut prompts = vec!["x y 1".to_string()];
    prompts.extend((0..n).map(|_| random_prompt(&mut rng, &vocab)));
    for (i, prompt) in prompts.iter().enumerate() {
        let seed = i as u64;
        let body = json!({"prompt": prompt, "max_tokens": 12, "temperature": 1.0, "seed": seed,
                          "logprobs": 1});
        let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
        assert_eq!(status, 200, "{v}");
        let choice = &v["choices"][0];
        let text = choice["text"].as_str().unwrap();
        let tokens: Vec<&str> = choice["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        assert_eq!(tokens.concat(), text, "prompt {prompt:?}");
        assert_eq!(
            tokens.len(),
            v["usage"]["completion_tokens"].as_u64().unwrap() as usize
        );
        let offsets = choice["logprobs"]["text_offset"].as_array().unwrap();
        let mut at = 0;
        for (t, off) in tokens.iter().zip(offsets) {
            assert_eq!(off.as_u64().unwrap() as usize, at, "prompt {prompt:?}");
            at += t.chars().count();
        }
        // The same through the library: a word token (not punctuation,
        // not a skipped special token) starts with its space.
        let lib = s
            .handle()
            .complete(
                GenerateRequest::new(prompt.as_str(), 12).with_sampling(SamplingOptions {
                    temperature: 1.0,
                    seed: Some(seed),
                    ..SamplingOptions::default()
                }),
            )
            .await
            .unwrap();
        assert_eq!(lib.text, text, "prompt {prompt:?}");
        if let Some(first) = lib.tokens.first() {
            let own = tok.token_text(first.id).unwrap();
            if own.starts_with(' ') {
                assert!(
                    text.starts_with(&own),
                    "prompt {prompt:?}: {text:?} vs {own:?}"
                );
            }
        }
        // Streamed: the chunks' tokens concatenate to the streamed text.
        let mut stream_body = body.clone();
        stream_body["stream"] = json!(true);
        let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/completions"), &stream_body).await);
        let (mut streamed, mut streamed_tokens) = (String::new(), String::new());
        for ch in &chunks {
            streamed.push_str(ch["choices"][0]["text"].as_str().unwrap_or(""));
            if let Some(ts) = ch["choices"][0]["logprobs"]["tokens"].as_array() {
                for t in ts {
                    streamed_tokens.push_str(t.as_str().unwrap());
                }
            }
        }
        assert_eq!(streamed, text, "prompt {prompt:?}");
        assert_eq!(streamed_tokens, text, "prompt {prompt:?}");
    }
}

/// A stop string: `usage.completion_tokens` counts the tokens returned, the
/// same ones `logprobs` lists (the swallowed ones are in neither).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_string_usage_agrees_with_logprobs() {
    let s = TestServer::ready();
    let c = client();
    let (full, _) = library_text(&s, "a b c", 16).await;
    let words: Vec<&str> = full.split(' ').collect();
    assert!(words.len() > 6, "{full}");
    // Stop on two words at once: two tokens swallowed.
    let stop = format!(" {} {}", words[4], words[5]);
    let body = json!({"prompt": "a b c", "max_tokens": 16, "temperature": 0, "stop": stop,
                      "logprobs": 0});
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    let tokens = choice["logprobs"]["tokens"].as_array().unwrap();
    let text = choice["text"].as_str().unwrap();
    assert_eq!(text, &full[..full.find(&stop).unwrap()]);
    assert_eq!(v["usage"]["completion_tokens"], tokens.len());
    assert_eq!(
        v["usage"]["total_tokens"],
        v["usage"]["prompt_tokens"].as_u64().unwrap() + tokens.len() as u64
    );
    let joined: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, text);
}

/// Malformed request heads, each on its own connection.
fn malformed_heads() -> Vec<(&'static str, Vec<u8>)> {
    let post = |header: &str| {
        format!("POST /v1/completions HTTP/1.1\r\nHost: t\r\n{header}\r\n\r\n{{}}").into_bytes()
    };
    vec![
        (
            "invalid Content-Type",
            post("Content-Type: application/\x01json"),
        ),
        ("Content-Length -1", post("Content-Length: -1")),
        (
            "Content-Length of 20 digits",
            post("Content-Length: 99999999999999999999"),
        ),
        (
            "NUL in a header",
            b"GET /health HTTP/1.1\r\nHost: t\r\nX-A: a\0b\r\n\r\n".to_vec(),
        ),
        (
            "oversized head",
            format!(
                "GET /health HTTP/1.1\r\nHost: t\r\nX-Big: {}\r\n\r\n",
                "a".repeat(200 * 1024)
            )
            .into_bytes(),
        ),
        (
            "oversized URI",
            format!(
                "GET /{} HTTP/1.1\r\nHost: t\r\n\r\n",
                "a".repeat(200 * 1024)
            )
            .into_bytes(),
        ),
        (
            "garbage request line",
            b"\x16\x03\x01 hello\r\n\r\n".to_vec(),
        ),
    ]
}

/// Defect 2: malformed heads get OpenAI-shaped JSON 4xx bodies, and the
/// server's log has no ERROR line for them and no colour codes (stderr is
/// a file here); `--log-format json` writes JSON lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_heads_get_json_errors_and_no_error_log() {
    for format in ["text", "json"] {
        let log = std::env::temp_dir().join(format!(
            "tandem-malformed-{}-{format}.log",
            std::process::id()
        ));
        let mut server = BinaryServer::spawn_logging(&["--log-format", format], "info", Some(&log));
        for (what, head) in malformed_heads() {
            let (status, _, body, closed) =
                raw_exchange(server.addr, &head, Duration::from_secs(10));
            assert!((400..500).contains(&status), "{what}: {status} {body}");
            let v: Value = serde_json::from_str(&body)
                .unwrap_or_else(|e| panic!("{what}: a JSON body, got {body:?}: {e}"));
            assert_eq!(v["error"]["type"], "invalid_request_error", "{what}: {v}");
            assert!(v["error"]["message"].is_string(), "{what}: {v}");
            assert!(closed, "{what}: the connection is closed");
        }
        // Still serving.
        let c = client();
        let (status, v) = post_json(
            &c,
            &server.url("/v1/completions"),
            &json!({"prompt": "x", "max_tokens": 2}),
        )
        .await;
        assert_eq!(status, 200, "{v}");
        drop(c);
        server.signal("TERM");
        assert_eq!(
            server
                .wait_exit(Duration::from_secs(20))
                .and_then(|s| s.code()),
            Some(0)
        );
        let text = std::fs::read_to_string(&log).expect("the log");
        let _ = std::fs::remove_file(&log);
        assert!(text.contains("ready"), "the log was captured: {text}");
        assert!(!text.contains('\x1b'), "no ANSI codes: {text:?}");
        for line in text.lines() {
            match format {
                "json" => {
                    let v: Value = serde_json::from_str(line)
                        .unwrap_or_else(|e| panic!("a JSON line, got {line:?}: {e}"));
                    assert_ne!(v["level"], "ERROR", "{line}");
                }
                _ => assert!(!line.contains("ERROR"), "{line}"),
            }
        }
    }
}

/// A burst into an idle server is admitted up to `max_queue` + the free
/// slots (those requests take the slots at the next step), and the next
/// one is a 429 with `Retry-After`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_fills_the_free_slots_and_the_queue() {
    let s = TestServer::start(Options {
        sched: SchedulerConfig {
            max_seqs: 4,
            max_queue: 2,
            step_token_budget: 64,
            max_prefill_chunk: 32,
            prefix_caching: true,
        },
        ..Options::default()
    });
    let c = client();
    let burst = (0..6).map(|i| {
        s.handle()
            .generate(GenerateRequest::new(format!("burst {i}"), 900))
    });
    let streams: Vec<_> = join_all(burst)
        .await
        .into_iter()
        .map(|r| r.expect("admitted: 4 free slots + a queue of 2"))
        .collect();
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "one too many"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    drop(streams);
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0 && m.get("tandem_queue_depth") == 0.0
        })
        .await;
    assert_eq!(m.outcome("cancelled"), 6.0);
}
