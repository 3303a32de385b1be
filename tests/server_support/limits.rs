//! Limits and failure paths: bad input, API key, full queue, loading and
//! shutdown, client disconnects, `/metrics`.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disconnecting_client_frees_its_slot() {
    let s = TestServer::ready();
    let c = client();
    let body = json!({"prompt": "go on", "max_tokens": 1000, "temperature": 0, "stream": true});
    let mut r = c
        .post(s.url("/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let first = r.chunk().await.unwrap().expect("a first chunk");
    assert!(first.starts_with(b"data: "));
    let m = s.metrics(&c).await;
    assert_eq!(m.get("tandem_running_sequences"), 1.0, "generating");
    drop(r);
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0 && m.get("tandem_releasing_sequences") == 0.0
        })
        .await;
    assert_eq!(m.get("tandem_running_sequences"), 0.0);
    assert_eq!(m.get("tandem_free_slots"), m.get("tandem_max_sequences"));
    assert_eq!(m.outcome("cancelled"), 1.0, "cancelled, not finished");
    assert_eq!(m.outcome("finished"), 0.0);
    assert!(m.get("tandem_generated_tokens_total") < 1000.0);
}

/// Every bad-input class gets its status and names its field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_status_and_name_the_field() {
    let s = TestServer::start(Options {
        http: HttpConfig {
            body_limit: 64 * 1024,
            ..HttpConfig::default()
        },
        ..Options::default()
    });
    let c = client();
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let long_prompt: Vec<u32> = vec![5; TEST_CONTEXT + 10];
    let cases: Vec<(&str, Value, u16, Option<&str>)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "x", "temperature": "hot"}),
            400,
            Some("temperature"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_p": 1.5}),
            400,
            Some("top_p"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "n": 0}),
            400,
            Some("n"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 0}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "max_tokens": 5000}),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": true}),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "logprobs": 21}),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "stop": [true]}),
            400,
            Some("stop[0]"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "seed": "s"}),
            400,
            Some("seed"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "top_k": -5}),
            400,
            Some("top_k"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "repetition_penalty": -1}),
            400,
            Some("repetition_penalty"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long_prompt}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1, 99999]}),
            400,
            Some("prompt[1]"),
        ),
        (
            "/v1/completions",
            json!({"max_tokens": 3}),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "tandem": {"mtp": "head:/m"}}),
            400,
            Some("tandem.mtp"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x", "echo": "yes"}),
            400,
            Some("echo"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "m"}),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "bot", "content": "x"}]}),
            400,
            Some("messages[0].role"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"top_logprobs": 3})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"logprobs": true, "top_logprobs": 25})),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"stream_options": {"include_usage": "yes"}})),
            400,
            Some("stream_options.include_usage"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"presence_penalty": 2.5})),
            400,
            Some("presence_penalty"),
        ),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function"}]})),
            400,
            Some("tools[0].function"),
        ),
    ];
    for (path, body, status, param) in cases {
        let (got, v) = post_json(&c, &s.url(path), &body).await;
        assert_eq!(got, status, "{path} {body}: {v}");
        let err = &v["error"];
        assert_eq!(err["param"].as_str(), param, "{body}: {v}");
        let message = err["message"].as_str().unwrap();
        if let Some(p) = param {
            let root = p.split(['[', '.']).next().unwrap();
            assert!(message.contains(root), "message names {root}: {message}");
        }
        assert_eq!(err["type"], "invalid_request_error");
        assert!(err["code"].is_string());
    }

    // Malformed JSON and a non-object body.
    for raw in ["{\"prompt\": ", "[1, 2]", ""] {
        let r = c
            .post(s.url("/v1/completions"))
            .header("content-type", "application/json")
            .body(raw)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{raw:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_json");
    }

    // Over the body limit: 413, whether announced by Content-Length or not.
    let big = json!({"prompt": "x".repeat(100 * 1024)});
    let (got, v) = post_json(&c, &s.url("/v1/completions"), &big).await;
    assert_eq!(got, 413, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("65536"));
    let chunked = reqwest::Body::wrap_stream(futures_util::stream::iter(
        (0..40).map(|_| Ok::<_, std::io::Error>(vec![b' '; 4096])),
    ));
    let r = c
        .post(s.url("/v1/completions"))
        .body(chunked)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);

    // Unknown route: a JSON 404.
    let r = c.get(s.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "not_found");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_429() {
    let s = TestServer::start(Options {
        sched: SchedulerConfig {
            max_seqs: 1,
            max_queue: 1,
            step_token_budget: 64,
            max_prefill_chunk: 32,
            prefix_caching: true,
        },
        ..Options::default()
    });
    let c = client();
    let long = json!({"prompt": "busy", "max_tokens": 1000, "temperature": 0, "stream": true});
    // One running, one queued …
    let mut running = c
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert!(running.chunk().await.unwrap().is_some());
    let queued = c
        .post(s.url("/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(queued.status(), 200);
    // … and the next is refused at once, with a Retry-After.
    let r = c
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    assert_eq!(v["error"]["code"], "overloaded");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_queue"));
    drop((running, queued));
    let m = s
        .wait_metrics(&c, Duration::from_secs(5), |m| {
            m.get("tandem_running_sequences") == 0.0 && m.get("tandem_queue_depth") == 0.0
        })
        .await;
    assert_eq!(m.get("tandem_queue_depth"), 0.0);
    assert_eq!(m.outcome("rejected"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loading_and_shutting_down_are_503() {
    let s = TestServer::start(Options {
        ready: false,
        ..Options::default()
    });
    let c = client();
    let r = c.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "loading");
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &json!({"prompt": "x"})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("model_loading"))
    );
    let m = s.metrics(&c).await;
    assert_eq!(m.get("tandem_ready"), 0.0);
    s.state.begin_shutdown();
    let r = c.get(s.url("/health")).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "shutting_down");
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &json!({})).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (503, Some("shutting_down"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_is_enforced() {
    let s = TestServer::start(Options {
        http: HttpConfig {
            api_key: Some("sekret".into()),
            ..HttpConfig::default()
        },
        ..Options::default()
    });
    let c = client();
    let body = json!({"prompt": "x", "max_tokens": 2});
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("sekret"),
        Some("Bearer sekret2"),
    ] {
        let mut req = c.post(s.url("/v1/completions")).json(&body);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{auth:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["type"], "authentication_error");
    }
    let r = c.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(s.url("/v1/completions"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(s.url("/v1/models"))
        .bearer_auth("sekret")
        .send()
        .await
        .unwrap();
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "tandem-tiny-test");
    assert_eq!(v["data"][0]["max_model_len"], TEST_CONTEXT);
    // Probes need no key.
    assert_eq!(c.get(s.url("/health")).send().await.unwrap().status(), 200);
    assert_eq!(c.get(s.url("/metrics")).send().await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_and_counters_move() {
    let s = TestServer::ready();
    let c = client();
    let before = s.metrics(&c).await;
    for name in [
        "tandem_queue_depth",
        "tandem_running_sequences",
        "tandem_generated_tokens_total",
        "tandem_steps_total",
        "tandem_mtp_drafted_tokens_total",
        "tandem_mtp_accepted_tokens_total",
    ] {
        assert!(before.docs.contains_key(name), "{name} documented");
        assert_eq!(before.get(name), 0.0, "{name} starts at 0");
    }
    assert_eq!(before.get("tandem_ready"), 1.0);
    let body = json!({"prompt": "count me", "max_tokens": 7, "temperature": 0});
    let (status, _) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200);
    let body = json!({"messages": [{"role": "user", "content": "and me"}], "max_tokens": 5,
                      "temperature": 0.7, "seed": 3, "stream": true});
    post_stream(&c, &s.url("/v1/chat/completions"), &body).await;
    let after = s.metrics(&c).await;
    assert_eq!(after.get("tandem_generated_tokens_total"), 12.0);
    assert_eq!(after.outcome("finished"), 2.0);
    assert!(after.get("tandem_steps_total") >= 7.0);
    assert!(after.get("tandem_prompt_tokens_total") > 0.0);
    let sampler = after
        .value("tandem_sampler_calls_total", &[("path", "uniform")])
        .unwrap()
        + after
            .value("tandem_sampler_calls_total", &[("path", "serial")])
            .unwrap();
    assert!(sampler >= 7.0, "one sampler call per step");
    assert_eq!(
        after.histogram_count("tandem_time_to_first_token_seconds"),
        2
    );
    assert!(after.histogram_count("tandem_batch_size") >= 7);
    assert!(after.histogram_count("tandem_inter_token_latency_seconds") > 0);
    let ok = |route| {
        after.value(
            "tandem_http_responses_total",
            &[("route", route), ("code", "200")],
        )
    };
    assert_eq!(ok("completions"), Some(1.0));
    assert_eq!(ok("chat_completions"), Some(1.0));
}

/// Starts a streamed completion, waits for its first chunk, and reads the
/// rest of the stream in a task (the text after the first chunk).
async fn stream_in_background(
    c: &reqwest::Client,
    s: &TestServer,
    body: &serde_json::Value,
) -> tokio::task::JoinHandle<String> {
    let mut r = c
        .post(s.url("/v1/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some());
    tokio::spawn(async move {
        let mut rest = String::new();
        while let Ok(Some(bytes)) = r.chunk().await {
            rest.push_str(&String::from_utf8_lossy(&bytes));
        }
        rest
    })
}

/// Shutdown lets short requests finish and cancels what outlives the drain
/// timeout (`finish_reason: "abort"`); afterwards requests get 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_then_aborts() {
    let s = TestServer::ready();
    let c = client();
    let long = json!({"prompt": "long", "max_tokens": 1000, "temperature": 0, "stream": true});
    let reader = stream_in_background(&c, &s, &long).await;
    let outcome = s.shutdown(Duration::from_millis(1)).await;
    assert_eq!(outcome, ShutdownOutcome::Aborted);
    let rest = reader.await.unwrap();
    assert!(rest.contains("\"finish_reason\":\"abort\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"));
    assert_eq!(s.state.phase_name(), "shutting_down");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_drains_short_requests() {
    let s = TestServer::ready();
    let c = client();
    let body = json!({"prompt": "short", "max_tokens": 50, "temperature": 0, "stream": true});
    let reader = stream_in_background(&c, &s, &body).await;
    assert_eq!(
        s.shutdown(Duration::from_secs(20)).await,
        ShutdownOutcome::Drained
    );
    let rest = reader.await.unwrap();
    assert!(rest.contains("\"finish_reason\":\"length\""), "{rest}");
    assert!(rest.ends_with("data: [DONE]\n\n"));
}
