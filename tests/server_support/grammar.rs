//! Structured output over HTTP (issue #19): `response_format` with JSON
//! schemas (a property test over random schemas, every output validated
//! with the `jsonschema` crate), masks in a batch mixing constrained and
//! unconstrained requests, `logit_bias`, stop token ids, and the 400s that
//! name the field.

use futures_util::future::join_all;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::{json, Value};

use super::server_support::*;

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// A random schema of depth ≤ `depth`: objects with required and optional
/// fields, arrays with bounded lengths, enums, integers and numbers with
/// bounds, bounded strings, booleans. Bounded so that a random model can
/// close every document well inside the token limit.
fn random_schema(rng: &mut ChaCha8Rng, depth: u32) -> Value {
    let leaf = depth == 0;
    let kind = rng.random_range(0..if leaf { 5 } else { 7 });
    schema_of_kind(rng, depth, kind)
}

/// Kind 6 is an object, 5 an array, 0–4 the leaves.
fn schema_of_kind(rng: &mut ChaCha8Rng, depth: u32, kind: u32) -> Value {
    match kind {
        0 => {
            let lo = rng.random_range(-50..50);
            json!({"type": "integer", "minimum": lo, "maximum": lo + rng.random_range(0..100)})
        }
        1 => json!({"type": "number", "minimum": -10.5, "maximum": 99.25}),
        2 => json!({"enum": ["red", "green", 7, null, true]}),
        3 => json!({"type": "boolean"}),
        4 => json!({"type": "string", "maxLength": rng.random_range(0..8)}),
        5 => {
            let min = rng.random_range(0..2);
            json!({
                "type": "array",
                "items": random_schema(rng, depth - 1),
                "minItems": min,
                "maxItems": min + rng.random_range(0..3),
            })
        }
        _ => {
            let n = rng.random_range(1..4);
            let mut props = serde_json::Map::new();
            let mut required = Vec::new();
            for i in 0..n {
                let name = format!("f{i}_{}", rng.random_range(0..100));
                if rng.random_bool(0.6) {
                    required.push(json!(name.clone()));
                }
                props.insert(name, random_schema(rng, depth - 1));
            }
            json!({
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": false,
            })
        }
    }
}

fn json_schema_format(schema: &Value) -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "out", "strict": true, "schema": schema}})
}

/// Whether `text` parses and validates against `schema`.
fn validates(schema: &Value, text: &str) -> Result<(), String> {
    let doc: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let validator = jsonschema::validator_for(schema).map_err(|e| format!("schema: {e}"))?;
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("; "))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_random_schemas_always_validate_or_end_with_length() {
    let s = TestServer::ready();
    let c = client();
    let mut rng = ChaCha8Rng::seed_from_u64(19);
    let (mut valid, mut length) = (0, 0);
    for case in 0..24u64 {
        // Mostly objects at the top, as structured output usually is.
        let kind = if case % 4 == 3 {
            rng.random_range(0..6)
        } else {
            6
        };
        let schema = schema_of_kind(&mut rng, 2, kind);
        let route = if case % 2 == 0 {
            "/v1/chat/completions"
        } else {
            "/v1/completions"
        };
        let mut body = json!({
            "max_tokens": 300, "temperature": 1.0, "seed": case,
            "response_format": json_schema_format(&schema),
        });
        if route == "/v1/completions" {
            body["prompt"] = json!("the answer is");
        } else {
            body["messages"] = json!([{"role": "user", "content": "answer in json"}]);
        }
        let (status, v) = post_json(&c, &s.url(route), &body).await;
        assert_eq!(status, 200, "case {case} {schema}: {v}");
        let choice = &v["choices"][0];
        let text = choice["text"]
            .as_str()
            .or(choice["message"]["content"].as_str())
            .unwrap();
        match choice["finish_reason"].as_str() {
            Some("stop") => {
                validates(&schema, text)
                    .unwrap_or_else(|e| panic!("case {case}: {e}\nschema {schema}\noutput {text}"));
                valid += 1;
            }
            Some("length") => length += 1,
            other => panic!("case {case}: finish {other:?}"),
        }
    }
    // Bounded schemas: a random model still closes most documents.
    assert!(valid >= 18, "{valid} valid, {length} cut by length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_json_object_and_regex_and_lark() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/completions");
    let base = json!({"prompt": "hello", "max_tokens": 200, "temperature": 0.7, "seed": 3});
    let mut body = base.clone();
    body["response_format"] = json!({"type": "json_object"});
    let (status, v) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    if v["choices"][0]["finish_reason"] == "stop" {
        let doc: Value = serde_json::from_str(v["choices"][0]["text"].as_str().unwrap()).unwrap();
        assert!(doc.is_object(), "{doc}");
    }
    let mut body = base.clone();
    body["tandem"] = json!({"grammar": {"type": "regex", "pattern": "(yes|no)-[0-9]{2}"}});
    let (status, v) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text}");
    assert!(
        (text.starts_with("yes-") || text.starts_with("no-"))
            && text.len() == text.find('-').unwrap() + 3,
        "{text:?}"
    );
    let mut body = base.clone();
    body["tandem"] = json!({"grammar": {"type": "lark", "grammar": "start: \"[\" item (\", \" item)* \"]\"\nitem: /[a-c]/"}});
    body["max_tokens"] = json!(400);
    let (status, v) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with('['), "{text:?}");
    assert!(
        text[1..].chars().all(|ch| "abc, ]".contains(ch)),
        "{text:?}"
    );
}

/// The same requests alone and all at once (greedy and seeded, constrained
/// and not): each gets the same text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_masks_in_a_mixed_batch_change_no_ones_tokens() {
    let s = TestServer::ready();
    let c = client();
    let schema = json!({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 999},
        "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4},
    }, "required": ["a", "b"], "additionalProperties": false});
    let bodies: Vec<Value> = (0..8u64)
        .map(|i| {
            let mut b = json!({"prompt": format!("case {i}"), "max_tokens": 40});
            if i % 2 == 0 {
                b["temperature"] = json!(0);
            } else {
                b["temperature"] = json!(0.9);
                b["seed"] = json!(100 + i);
            }
            if i % 4 < 2 {
                b["response_format"] = json_schema_format(&schema);
            }
            b
        })
        .collect();
    let url = s.url("/v1/completions");
    let mut alone = Vec::new();
    for b in &bodies {
        let (status, v) = post_json(&c, &url, b).await;
        assert_eq!(status, 200, "{v}");
        alone.push(v["choices"][0]["text"].as_str().unwrap().to_string());
    }
    let together = join_all(bodies.iter().map(|b| post_json(&c, &url, b))).await;
    for (i, ((status, v), want)) in together.into_iter().zip(&alone).enumerate() {
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["choices"][0]["text"].as_str().unwrap(),
            want,
            "request {i}"
        );
    }
    for (i, text) in alone.iter().enumerate().filter(|(i, _)| i % 4 < 2) {
        if serde_json::from_str::<Value>(text).is_ok() {
            validates(&schema, text).unwrap_or_else(|e| panic!("request {i}: {e}: {text}"));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_logit_bias_and_stop_token_ids_steer_the_tokens() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/completions");
    // A +100 bias on one id makes every token that id.
    let word = tandem::tokenizer::word_vocab::FIXED_TOKENS as u32 + 11;
    let body = json!({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0.8, "seed": 1,
        "logprobs": 0, "logit_bias": {word.to_string(): 100}});
    let (status, v) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    let tokens = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .len();
    let text = v["choices"][0]["text"].as_str().unwrap();
    let want = s.handle().tokenizer().token_text(word).unwrap();
    assert_eq!(text, want.repeat(4), "{tokens} tokens");
    // The greedy second token, given as a stop id, ends the answer after it.
    let done = s
        .handle()
        .complete(tandem::api::GenerateRequest::new(
            tandem::api::Prompt::Tokens(vec![5, 6, 7]),
            6,
        ))
        .await
        .unwrap();
    let second = done.tokens[1].id;
    let first = done.tokens[0].id;
    let stopped = json!({"prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0,
        "stop": [second]});
    let (status, v) = post_json(&c, &url, &stopped).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let expected = if first == second { 1 } else { 2 };
    assert_eq!(v["usage"]["completion_tokens"], expected, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_bad_constraints_are_400s_naming_the_field() {
    let s = TestServer::ready();
    let c = client();
    let chat = |extra: Value| {
        let mut b = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let cases = [
        (
            json!({"response_format": json_schema_format(&json!({"type": "integer", "minimum": 5, "maximum": 1}))}),
            "response_format",
        ),
        (
            json!({"response_format": json_schema_format(&json!({"type": "no-such-type"}))}),
            "response_format",
        ),
        (
            json!({"response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            json!({"tandem": {"grammar": {"type": "lark", "grammar": "start: ("}}}),
            "tandem.grammar",
        ),
        (
            json!({"tandem": {"grammar": {"type": "regex", "pattern": "(a"}}}),
            "tandem.grammar",
        ),
        (json!({"logit_bias": {"abc": 1}}), "logit_bias"),
        (json!({"logit_bias": {"3": 500}}), "logit_bias.3"),
        (json!({"logit_bias": {"3": "x"}}), "logit_bias.3"),
        (json!({"logit_bias": {"99999999": 1}}), "logit_bias"),
        (json!({"stop": [99999999]}), "stop"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tool_choice": 3}), "tool_choice"),
    ];
    for (extra, param) in cases {
        let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &chat(extra.clone())).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
    }
    // The server still serves after all of them.
    let (status, _) = post_json(&c, &s.url("/v1/chat/completions"), &chat(json!({}))).await;
    assert_eq!(status, 200);
}

/// The real model (SmolLM2-135M-Instruct, the GGUF in `../shared`) under a
/// JSON schema: greedy output that parses and validates, streamed and not.
/// The schema bounds every field, as a client that needs a finished
/// document within `max_tokens` would: unbounded, this model's greedy
/// number can repeat a digit until the limit (`population_millions:
/// 1111…`), and which path greedy takes turns on last-bit differences
/// between CPU tiers (seen when attention's score order changed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_smollm2_answers_in_schema() {
    let Some(dir) = tandem::testing::shared("models/smollm2-135m-instruct") else {
        return;
    };
    let s = TestServer::start(Options {
        model: TestModel::Path(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")),
        ..Options::default()
    });
    let c = client();
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 100},
    }, "required": ["city", "country", "population_millions"], "additionalProperties": false});
    let body = json!({
        "messages": [{"role": "user", "content": "Describe Paris as JSON with city, country and population_millions."}],
        "max_tokens": 80, "temperature": 0,
        "response_format": json_schema_format(&schema),
    });
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{text}");
    validates(&schema, text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_chunks(&post_stream(&c, &s.url("/v1/chat/completions"), &streamed).await);
    let joined: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(joined, text);
    // Unbounded, the answer validates, or it is cut at `max_tokens`.
    let open = json!({"type": "object", "properties": {
        "city": {"type": "string"},
        "country": {"type": "string"},
        "population_millions": {"type": "number"},
    }, "required": ["city", "country", "population_millions"], "additionalProperties": false});
    let mut unbounded = body.clone();
    unbounded["response_format"] = json_schema_format(&open);
    let (status, v) = post_json(&c, &s.url("/v1/chat/completions"), &unbounded).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    match v["choices"][0]["finish_reason"].as_str() {
        Some("stop") => validates(&open, text).unwrap_or_else(|e| panic!("{e}: {text}")),
        Some("length") => assert!(text.starts_with('{'), "{text}"),
        other => panic!("finish_reason {other:?}: {text}"),
    }
}

/// The official `openai` client (`tests/openai_structured.py`): `parse()`
/// with a Pydantic model, a tool-call round trip, streamed tool-call
/// deltas, 400s; on the embedded model and on SmolLM2.
#[test]
fn grammar_official_openai_client_structured_output() {
    let probe = std::process::Command::new("python3")
        .args(["-c", "import openai, pydantic"])
        .output();
    if !probe.is_ok_and(|o| o.status.success()) {
        tandem::testing::skip(
            "TANDEM_REQUIRE_OPENAI_CLIENT",
            "grammar_official_openai_client_structured_output: `import openai, pydantic` failed (pip install openai)",
        );
        return;
    }
    let mut runs = vec![("embedded", Vec::new())];
    if let Some(dir) = tandem::testing::shared("models/smollm2-135m-instruct") {
        let gguf = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        runs.push((
            "smollm2",
            vec!["--model".to_string(), gguf.display().to_string()],
        ));
    }
    for (kind, args) in runs {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let server = BinaryServer::spawn(&args);
        run_client_script(&server, "openai_structured.py", &[kind]);
    }
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        }, "required": ["city", "days"], "additionalProperties": false},
    }})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_time", "parameters": {"type": "object", "properties": {
            "zone": {"enum": ["utc", "cet"]}}, "required": ["zone"], "additionalProperties": false},
    }})
}

/// Each call's arguments validate against its function's schema.
fn assert_calls_valid(calls: &[Value], tools: &[Value]) {
    for call in calls {
        let name = call["function"]["name"].as_str().unwrap();
        let tool = tools
            .iter()
            .find(|t| t["function"]["name"] == name)
            .unwrap_or_else(|| panic!("unknown function {name}"));
        let args = call["function"]["arguments"].as_str().unwrap();
        validates(&tool["function"]["parameters"], args)
            .unwrap_or_else(|e| panic!("{name}: {e}: {args}"));
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
        assert_eq!(call["type"], "function");
    }
}

/// The embedded model (a template without tools: the generic format):
/// `required`, named and streamed calls are valid for their schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_tool_calls_follow_the_function_schemas() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/chat/completions");
    let tools = vec![weather_tool(), time_tool()];
    for (seed, choice, parallel) in [
        (1, json!("required"), true),
        (2, json!("required"), false),
        (
            3,
            json!({"type": "function", "function": {"name": "get_time"}}),
            true,
        ),
    ] {
        let body = json!({
            "messages": [{"role": "user", "content": "weather and time?"}],
            "tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel,
            "max_tokens": 300, "temperature": 1.0, "seed": seed,
        });
        let (status, v) = post_json(&c, &url, &body).await;
        assert_eq!(status, 200, "{v}");
        let choice_out = &v["choices"][0];
        assert_eq!(choice_out["finish_reason"], "tool_calls", "{v}");
        let calls = choice_out["message"]["tool_calls"].as_array().unwrap();
        assert!(!calls.is_empty());
        if !parallel {
            assert_eq!(calls.len(), 1, "{v}");
        }
        if seed == 3 {
            assert!(
                calls.iter().all(|c| c["function"]["name"] == "get_time"),
                "{v}"
            );
        }
        assert_calls_valid(calls, &tools);
        // Streamed: the same calls, as tool_calls deltas.
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let chunks = sse_chunks(&post_stream(&c, &url, &streamed).await);
        let deltas: Vec<Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
            .flatten()
            .cloned()
            .collect();
        // Joined per index as OpenAI's clients do, the deltas are the
        // whole response's calls; the arguments came in several pieces.
        let mut joined: Vec<Value> = Vec::new();
        for d in &deltas {
            let i = d["index"].as_u64().unwrap() as usize;
            if i == joined.len() {
                assert!(d["id"].is_string() && d["type"] == "function", "{d}");
                joined.push(d.clone());
            } else {
                let args = d["function"]["arguments"].as_str().unwrap();
                let whole = joined[i]["function"]["arguments"].as_str().unwrap();
                joined[i]["function"]["arguments"] = json!(format!("{whole}{args}"));
            }
        }
        assert_eq!(joined.len(), calls.len(), "{chunks:?}");
        assert!(deltas.len() > calls.len(), "arguments streamed: {deltas:?}");
        for (d, call) in joined.iter().zip(calls) {
            assert_eq!(d["function"], call["function"]);
        }
        let last = chunks
            .iter()
            .rev()
            .find(|c| !c["choices"][0]["finish_reason"].is_null());
        assert_eq!(last.unwrap()["choices"][0]["finish_reason"], "tool_calls");
    }
    // A round trip: the call and its result go back in, `none` answers.
    let body = json!({
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_9", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"oslo\", \"days\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "rain"},
        ],
        "tools": tools, "tool_choice": "none", "max_tokens": 8, "temperature": 0,
    });
    let (status, v) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    assert_eq!(v["system_fingerprint"], "tandem-0.1.0");
    // Bad tool shapes name the field.
    for (extra, param) in [
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"tool_choice": {"type": "function"}}),
            "tool_choice.function.name",
        ),
        (json!({"parallel_tool_calls": 1}), "parallel_tool_calls"),
        (
            json!({"response_format": {"type": "json_object"}, "tool_choice": "required"}),
            "tools",
        ),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "x"}], "tools": tools});
        for (k, val) in extra.as_object().unwrap() {
            body[k] = val.clone();
        }
        let (status, v) = post_json(&c, &url, &body).await;
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{v}"
        );
    }
    let bad_message = json!({"messages": [{"role": "tool", "content": "x", "tool_call_id": 5}]});
    let (status, v) = post_json(&c, &url, &bad_message).await;
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("messages[0].tool_call_id"))
    );
}

/// `echo` puts the prompt's text first, whole and streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_echo_prepends_the_prompt() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/completions");
    let plain = json!({"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 0});
    let (_, v) = post_json(&c, &url, &plain).await;
    let completion = v["choices"][0]["text"].as_str().unwrap().to_string();
    let mut echo = plain.clone();
    echo["echo"] = json!(true);
    let (status, v) = post_json(&c, &url, &echo).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["choices"][0]["text"],
        format!("the quick brown fox{completion}")
    );
    echo["stream"] = json!(true);
    let chunks = sse_chunks(&post_stream(&c, &url, &echo).await);
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(text, format!("the quick brown fox{completion}"));
    // Several choices each start with the prompt, whole and streamed.
    let several = json!({"prompt": "the quick brown fox", "max_tokens": 5, "temperature": 1.0,
        "seed": 2, "n": 2, "echo": true});
    let (status, v) = post_json(&c, &url, &several).await;
    assert_eq!(status, 200, "{v}");
    let whole: Vec<String> = (0..2)
        .map(|i| v["choices"][i]["text"].as_str().unwrap().to_string())
        .collect();
    for text in &whole {
        assert!(text.starts_with("the quick brown fox"), "{v}");
    }
    let mut stream = several.clone();
    stream["stream"] = json!(true);
    let chunks = sse_chunks(&post_stream(&c, &url, &stream).await);
    for (i, want) in whole.iter().enumerate() {
        let text: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .map(|c| c["choices"][0]["text"].as_str().unwrap_or(""))
            .collect();
        assert_eq!(&text, want, "choice {i}");
    }
}

/// A grammar the vocabulary cannot follow (the embedded words have no
/// `é`) fails its own request only; the request beside it is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_a_failing_grammar_fails_only_its_request() {
    let s = TestServer::ready();
    let c = client();
    let url = s.url("/v1/completions");
    let good = json!({"prompt": "hello", "max_tokens": 12, "temperature": 0});
    let (_, alone) = post_json(&c, &url, &good).await;
    let bad = json!({"prompt": "hello", "max_tokens": 12, "temperature": 0,
        "tandem": {"grammar": {"type": "regex", "pattern": "é+"}}});
    let ((bad_status, bad_v), (good_status, good_v)) =
        tokio::join!(post_json(&c, &url, &bad), post_json(&c, &url, &good));
    assert_eq!(bad_status, 500, "{bad_v}");
    let message = bad_v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("no token of the vocabulary can continue the grammar"),
        "{message}"
    );
    assert!(!message.contains("<state>"), "{message}");
    assert_eq!(good_status, 200, "{good_v}");
    assert_eq!(good_v["choices"][0]["text"], alone["choices"][0]["text"]);
}

/// `n` choices under one `response_format`: each choice follows the schema
/// on its own grammar state; each choice's tool calls are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grammar_several_choices_each_follow_the_schema() {
    let s = TestServer::ready();
    let c = client();
    let schema = json!({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["x", "y"]},
    }, "required": ["a", "b"], "additionalProperties": false});
    let body = json!({"prompt": "json", "max_tokens": 60, "temperature": 1.0, "seed": 4, "n": 3,
        "response_format": json_schema_format(&schema)});
    let (status, v) = post_json(&c, &s.url("/v1/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for choice in choices {
        assert_eq!(choice["finish_reason"], "stop", "{choice}");
        validates(&schema, choice["text"].as_str().unwrap()).unwrap();
    }
    // Tool calls in several choices: each choice's calls are parsed and
    // valid for the schema, under ids of their own, whole and streamed.
    let tools = vec![weather_tool()];
    let url = s.url("/v1/chat/completions");
    let body = json!({"messages": [{"role": "user", "content": "weather?"}], "tools": tools,
        "tool_choice": "required", "n": 2, "max_tokens": 300, "temperature": 1.0, "seed": 5});
    let (status, v) = post_json(&c, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{v}");
    let mut ids = std::collections::HashSet::new();
    for choice in choices {
        assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
        let calls = choice["message"]["tool_calls"].as_array().unwrap();
        assert_calls_valid(calls, &tools);
        for call in calls {
            assert!(ids.insert(call["id"].to_string()), "{v}");
        }
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = sse_chunks(&post_stream(&c, &url, &streamed).await);
    for (index, choice) in choices.iter().enumerate() {
        let of_choice = |c: &&Value| c["choices"][0]["index"] == index;
        let mut arguments = String::new();
        for chunk in chunks.iter().filter(of_choice) {
            for d in chunk["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                assert_eq!(d["index"], 0, "one call per choice: {d}");
                arguments.push_str(d["function"]["arguments"].as_str().unwrap());
            }
        }
        let want = &choice["message"]["tool_calls"][0]["function"]["arguments"];
        assert_eq!(arguments, want.as_str().unwrap(), "choice {index}");
        let finish = chunks
            .iter()
            .filter(of_choice)
            .find_map(|c| c["choices"][0]["finish_reason"].as_str());
        assert_eq!(finish, Some("tool_calls"), "choice {index}");
    }
}
