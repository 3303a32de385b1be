//! Tool calling on `/v1/chat/completions`: `tools`, `tool_choice`
//! (`none`, `auto`, `required`, a named function), `parallel_tool_calls`,
//! and tool messages (`role: tool` with `tool_call_id`, assistant
//! messages with `tool_calls`).
//!
//! # The one call format
//! Calls are Hermes / Qwen style, the format of templates that render
//! tools themselves: each call is
//! `<tool_call>\n{"name": "f", "arguments": {…}}\n</tool_call>`, calls
//! separated by a newline. [`parse_calls`] (whole answers) and
//! [`CallStream`] (streamed ones) turn that text into OpenAI `tool_calls`.
//!
//! # Two ways to tell the model
//! - **Templates that render tools** (their source mentions `tools`, as
//!   Hermes, Qwen 2.5 and Llama 3.1 templates do): the `tools` list goes
//!   into the template's context as Hugging Face passes it, and messages go
//!   in unchanged.
//! - **Templates that know nothing of tools** (SmolLM2's ChatML, the
//!   embedded model's plain format): the generic format, as llama.cpp's
//!   server does. The tool schemas and the call format go into the system
//!   prompt ([`ToolRequest::prepare_messages`]); earlier assistant calls
//!   are written back as call text and tool results are wrapped in
//!   `<tool_response>` tags.
//!
//! # What is enforced
//! `required` and a named function are a grammar (`tool_call_grammar`):
//! one or more calls (one when `parallel_tool_calls` is false), each
//! `name` one of the tools (or the named one) and its `arguments` valid
//! JSON for that function's `parameters` schema. `auto` under the generic
//! format is a grammar too: either calls or a plain answer (which may not
//! start with `<`); `auto` under a tool-aware template leaves the model
//! free and only parses. `none` describes nothing in the generic format
//! and parses nothing.

use serde_json::{json, Map, Value};

use super::body::Fields;
use super::chat_template::ChatMessage;
use super::errors::ApiError;
use super::params::check_tools;
use crate::structured::{Constraint, ConstraintOrigin, GrammarSpec};

pub const CALL_OPEN: &str = "<tool_call>";
pub const CALL_CLOSE: &str = "</tool_call>";

/// One function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments (`{"type": "object"}` when absent).
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A chat request's tools, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<ToolSpec>,
    pub choice: ToolChoice,
    pub parallel: bool,
    /// `tools` as the client sent them (what tool-aware templates render).
    pub raw: Value,
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no
/// tools were given (then `tool_choice` may only be `none` or `auto`).
pub fn parse_tools(f: &Fields) -> Result<Option<ToolRequest>, ApiError> {
    check_tools(f)?;
    let parallel = f.get::<bool>("parallel_tool_calls")?.unwrap_or(true);
    let Some(Value::Array(list)) = f.raw("tools") else {
        return Ok(None);
    };
    if list.is_empty() {
        return Ok(None);
    }
    let tools: Vec<ToolSpec> = list
        .iter()
        .map(|t| {
            let function = &t["function"];
            ToolSpec {
                name: function["name"].as_str().unwrap_or_default().to_string(),
                description: function["description"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                parameters: function
                    .get("parameters")
                    .cloned()
                    .unwrap_or_else(|| json!({"type": "object"})),
            }
        })
        .collect();
    let choice = match f.raw("tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            _ => ToolChoice::Required, // check_tools allowed only `required`
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| ApiError::missing_field("tool_choice.function.name"))?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid_field(
                    "tool_choice.function.name",
                    format!("`{name}` is not one of the `tools`"),
                ));
            }
            ToolChoice::Named(name.to_string())
        }
        // check_tools refuses every other shape; stay a 400 regardless.
        Some(other) => {
            return Err(ApiError::invalid_field(
                "tool_choice",
                format!("unexpected {}", super::body::describe(other)),
            ))
        }
    };
    Ok(Some(ToolRequest {
        tools,
        choice,
        parallel,
        raw: Value::Array(list.clone()),
    }))
}

impl ToolRequest {
    /// Whether the answer is parsed for calls.
    pub fn parses_calls(&self) -> bool {
        self.choice != ToolChoice::None
    }

    /// The generic format's tool prompt, joined to the system message (or
    /// a new one in front), for a template that knows nothing of tools.
    /// Nothing for `tool_choice: none`.
    pub fn add_tool_prompt(&self, messages: &mut Vec<ChatMessage>) {
        if self.choice == ToolChoice::None {
            return;
        }
        let prompt = self.system_prompt();
        match messages.first_mut() {
            Some(m) if m.role == "system" => {
                m.content = format!("{}\n\n{prompt}", m.content);
            }
            _ => messages.insert(0, ChatMessage::text("system", prompt)),
        }
    }

    fn system_prompt(&self) -> String {
        let mut out = String::from(
            "You can call functions. To call one, answer with only\n<tool_call>\n\
             {\"name\": \"<function name>\", \"arguments\": <arguments as a JSON object>}\n</tool_call>\n",
        );
        if self.parallel {
            out.push_str("(several calls: one block per call, one per line).\n");
        }
        out.push_str(match self.choice {
            ToolChoice::Auto => "If no function helps, answer the user directly.\n",
            _ => "You must call a function.\n",
        });
        out.push_str("Functions:\n");
        for t in &self.tools {
            out.push_str(&format!(
                "- {}: {} Arguments (JSON Schema): {}\n",
                t.name, t.description, t.parameters
            ));
        }
        out
    }

    /// The grammar the answer must follow, if any: `template_knows_tools`
    /// selects between the two ways of the module docs.
    pub fn constraint(&self, template_knows_tools: bool) -> Option<Constraint> {
        let grammar = match (&self.choice, template_knows_tools) {
            (ToolChoice::None, _) | (ToolChoice::Auto, true) => return None,
            (ToolChoice::Auto, false) => tool_call_grammar(&self.tools, self.parallel, true),
            (ToolChoice::Required, _) => tool_call_grammar(&self.tools, self.parallel, false),
            (ToolChoice::Named(name), _) => {
                let one: Vec<ToolSpec> = self
                    .tools
                    .iter()
                    .filter(|t| &t.name == name)
                    .cloned()
                    .collect();
                tool_call_grammar(&one, false, false)
            }
        };
        Some(Constraint::new(
            GrammarSpec::Lark { grammar },
            ConstraintOrigin::Tools,
        ))
    }
}

/// Lark: calls to `tools` (with `%json` arguments), optionally or a plain
/// answer that does not start with `<`.
fn tool_call_grammar(tools: &[ToolSpec], parallel: bool, or_text: bool) -> String {
    let calls = if parallel {
        "calls: call (\"\\n\" call)*"
    } else {
        "calls: call"
    };
    let start = if or_text {
        "start: calls | TEXT\nTEXT: /[^<][\\s\\S]*/"
    } else {
        "start: calls"
    };
    let alternatives: Vec<String> = (0..tools.len()).map(|i| format!("f{i}")).collect();
    let mut g = format!(
        "{start}\n{calls}\ncall: \"{CALL_OPEN}\\n\" body \"\\n{CALL_CLOSE}\"\nbody: {}\n",
        alternatives.join(" | ")
    );
    for (i, t) in tools.iter().enumerate() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
        });
        g.push_str(&format!("f{i}: %json {schema}\n"));
    }
    g
}

/// The generic format's rewrite of a conversation for a template that
/// knows nothing of tools: every assistant message's `tool_calls` become
/// call text, every tool message's content goes in `<tool_response>` tags.
pub fn write_back_all(messages: &mut [ChatMessage]) {
    messages.iter_mut().for_each(write_back_calls);
}

fn write_back_calls(m: &mut ChatMessage) {
    if let Some(Value::Array(calls)) = m.tool_calls.take() {
        for call in calls {
            let f = &call["function"];
            let args = match &f["arguments"] {
                Value::String(s) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
                other => other.clone(),
            };
            let body = json!({"name": f["name"], "arguments": args});
            if !m.content.is_empty() {
                m.content.push('\n');
            }
            m.content
                .push_str(&format!("{CALL_OPEN}\n{body}\n{CALL_CLOSE}"));
        }
    }
    if m.role == "tool" {
        m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
    }
}

/// One parsed call, as OpenAI shapes it.
fn call_json(index: usize, id: String, name: &str, arguments: String) -> Value {
    json!({
        "index": index,
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    })
}

/// The `(name, arguments as a JSON string)` of a call block's body.
fn parse_call_body(body: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let args = match v.get("arguments") {
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
        None => "{}".into(),
    };
    Some((name, args))
}

/// A whole answer split into its text and its calls. Call ids are
/// `call_{request}_{n}`. Text outside the blocks (trimmed) is the content;
/// a block that does not parse stays in the content.
pub fn parse_calls(text: &str, id_prefix: &str) -> (Option<String>, Vec<Value>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(CALL_OPEN) {
        let after = &rest[open + CALL_OPEN.len()..];
        let Some(close) = after.find(CALL_CLOSE) else {
            break;
        };
        match parse_call_body(&after[..close]) {
            Some((name, args)) => {
                content.push_str(&rest[..open]);
                let n = calls.len();
                calls.push(call_json(n, format!("{id_prefix}_{n}"), &name, args));
            }
            None => content.push_str(&rest[..open + CALL_OPEN.len() + close + CALL_CLOSE.len()]),
        }
        rest = &after[close + CALL_CLOSE.len()..];
    }
    content.push_str(rest);
    let content = content.trim();
    let content = (!content.is_empty() || calls.is_empty()).then(|| content.to_string());
    (content, calls)
}

/// Splits a streamed answer into content deltas and call deltas. Text that
/// could still be the start of a call block is held back until it is
/// known; a whole block becomes one `tool_calls` delta (id, name and the
/// complete arguments string), shaped like OpenAI's.
#[derive(Debug, Default)]
pub struct CallStream {
    pending: String,
    calls: usize,
    id_prefix: String,
}

impl CallStream {
    pub fn new(id_prefix: String) -> Self {
        Self {
            id_prefix,
            ..Self::default()
        }
    }

    /// Whether any call was sent (the finish reason is then `tool_calls`).
    pub fn called(&self) -> bool {
        self.calls > 0
    }

    /// New text in; the content to send now and the finished calls.
    pub fn push(&mut self, text: &str) -> (String, Vec<Value>) {
        self.pending.push_str(text);
        let mut content = String::new();
        let mut calls = Vec::new();
        loop {
            if let Some(open) = self.pending.find(CALL_OPEN) {
                let after = open + CALL_OPEN.len();
                let Some(close) = self.pending[after..].find(CALL_CLOSE) else {
                    // Inside a block: send what came before it, keep the rest.
                    content.push_str(&self.pending[..open]);
                    self.pending.drain(..open);
                    break;
                };
                let end = after + close + CALL_CLOSE.len();
                content.push_str(&self.pending[..open]);
                match parse_call_body(&self.pending[after..after + close]) {
                    Some((name, args)) => {
                        let n = self.calls;
                        self.calls += 1;
                        calls.push(call_json(n, format!("{}_{n}", self.id_prefix), &name, args));
                    }
                    None => content.push_str(&self.pending[open..end]),
                }
                self.pending.drain(..end);
                continue;
            }
            // No block start: keep only a tail that may begin one.
            let keep = partial_open_len(&self.pending);
            let send = self.pending.len() - keep;
            content.push_str(&self.pending[..send]);
            self.pending.drain(..send);
            break;
        }
        if self.calls > 0 {
            // Whitespace between calls is not content.
            content = content.trim().to_string();
        }
        (content, calls)
    }

    /// The end of the answer: whatever is held back is content.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// The length of the longest suffix of `s` that is a proper prefix of
/// [`CALL_OPEN`].
fn partial_open_len(s: &str) -> usize {
    (1..CALL_OPEN.len())
        .rev()
        .find(|&n| {
            s.len() >= n
                && s.is_char_boundary(s.len() - n)
                && CALL_OPEN.starts_with(&s[s.len() - n..])
        })
        .unwrap_or(0)
}

/// The tool fields of message `i` (`tool_calls` of an assistant message,
/// `tool_call_id` of a tool message), type-checked.
pub fn message_tool_fields(
    m: &Map<String, Value>,
    i: usize,
) -> Result<(Option<Value>, Option<String>), ApiError> {
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(v @ Value::Array(calls)) => {
            for (j, c) in calls.iter().enumerate() {
                let name = c.get("function").and_then(|f| f.get("name"));
                if !name.is_some_and(Value::is_string) {
                    return Err(ApiError::invalid_field(
                        format!("messages[{i}].tool_calls[{j}].function.name"),
                        "expected a string",
                    ));
                }
            }
            Some(v.clone())
        }
        Some(_) => {
            return Err(ApiError::invalid_field(
                format!("messages[{i}].tool_calls"),
                "expected a list of tool calls",
            ))
        }
    };
    let id = match m.get("tool_call_id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid_field(
                format!("messages[{i}].tool_call_id"),
                "expected a string",
            ))
        }
    };
    Ok((calls, id))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::server::body::parse_object;

    fn request(json: &str) -> Result<Option<ToolRequest>, ApiError> {
        parse_tools(&parse_object(json.as_bytes()).unwrap())
    }

    const TOOLS: &str = r#""tools":[{"type":"function","function":{"name":"get_weather","description":"Weather of a city.","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}]"#;

    #[test]
    fn choices_parse_and_bad_ones_are_named() {
        let r = request(&format!("{{{TOOLS}}}")).unwrap().unwrap();
        assert_eq!((r.choice.clone(), r.parallel), (ToolChoice::Auto, true));
        let r = request(&format!(
            r#"{{{TOOLS},"tool_choice":"required","parallel_tool_calls":false}}"#
        ))
        .unwrap()
        .unwrap();
        assert_eq!((r.choice, r.parallel), (ToolChoice::Required, false));
        let r = request(&format!(
            r#"{{{TOOLS},"tool_choice":{{"type":"function","function":{{"name":"get_weather"}}}}}}"#
        ))
        .unwrap()
        .unwrap();
        assert_eq!(r.choice, ToolChoice::Named("get_weather".into()));
        let param = |json: String| request(&json).unwrap_err().param.unwrap_or_default();
        assert_eq!(
            param(format!(
                r#"{{{TOOLS},"tool_choice":{{"type":"function","function":{{"name":"nope"}}}}}}"#
            )),
            "tool_choice.function.name"
        );
        assert_eq!(
            param(format!(r#"{{{TOOLS},"tool_choice":"maybe"}}"#)),
            "tool_choice"
        );
        assert_eq!(param(r#"{"tool_choice":"required"}"#.into()), "tool_choice");
        assert_eq!(
            param(format!(r#"{{{TOOLS},"parallel_tool_calls":"yes"}}"#)),
            "parallel_tool_calls"
        );
        assert!(request(r#"{"tools":[]}"#).unwrap().is_none());
    }

    #[test]
    fn whole_answers_split_into_content_and_calls() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>";
        let (content, calls) = parse_calls(text, "call_1");
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        assert_eq!(calls[0]["id"], "call_1_0");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris"}));
        let (content, calls) = parse_calls("just text", "c");
        assert_eq!((content.as_deref(), calls.len()), (Some("just text"), 0));
        let (content, calls) = parse_calls("<tool_call>\nnot json\n</tool_call>", "c");
        assert_eq!(calls.len(), 0);
        assert!(content.unwrap().contains("not json"));
    }

    #[test]
    fn streamed_answers_split_at_any_chunking() {
        let text =
            "Hi <b> <tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}\n</tool_call>";
        for size in 1..text.len() {
            let mut s = CallStream::new("c".into());
            let (mut content, mut calls) = (String::new(), Vec::new());
            let bytes: Vec<char> = text.chars().collect();
            for piece in bytes.chunks(size) {
                let (c, k) = s.push(&piece.iter().collect::<String>());
                content.push_str(&c);
                calls.extend(k);
            }
            content.push_str(&s.finish());
            assert_eq!(calls.len(), 1, "size {size}");
            assert_eq!(
                calls[0]["function"]["arguments"], "{\"x\":[1,2]}",
                "size {size}"
            );
            assert!(content.starts_with("Hi <b>"), "size {size}: {content:?}");
        }
    }

    #[test]
    fn grammars_compile_and_the_generic_prompt_names_the_tools() {
        let r = request(&format!(r#"{{{TOOLS},"tool_choice":"required"}}"#))
            .unwrap()
            .unwrap();
        let tok = crate::tokenizer::word_level_tokenizer(2000, 7).unwrap();
        let compiler = tok.grammar_compiler().unwrap();
        for knows in [false, true] {
            let c = r.constraint(knows).unwrap();
            compiler.compile(&c.spec).unwrap();
        }
        let auto = request(&format!("{{{TOOLS}}}")).unwrap().unwrap();
        assert!(auto.constraint(true).is_none());
        compiler
            .compile(&auto.constraint(false).unwrap().spec)
            .unwrap();
        let mut messages = vec![
            ChatMessage::text("user", "weather?".into()),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(json!([{"id": "c", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}])),
                ..ChatMessage::default()
            },
            ChatMessage {
                tool_call_id: Some("c".into()),
                ..ChatMessage::text("tool", "sunny".into())
            },
        ];
        write_back_all(&mut messages);
        auto.add_tool_prompt(&mut messages);
        assert_eq!(messages[0].role, "system");
        assert!(messages[0].content.contains("get_weather"));
        assert_eq!(
            messages[2].content,
            "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Paris\"}}\n</tool_call>"
        );
        assert_eq!(
            messages[3].content,
            "<tool_response>\nsunny\n</tool_response>"
        );
    }

    /// A Hermes-style template (one that renders `tools`) sees the tools
    /// and the messages' calls itself.
    #[test]
    fn a_tool_aware_template_renders_the_tools() {
        use crate::server::ChatTemplate;
        let src = "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}\
            {% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.function.name }}>{% endfor %}{% endif %}{% endfor %}";
        let t = ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
        assert!(t.knows_tools());
        let r = request(&format!("{{{TOOLS}}}")).unwrap().unwrap();
        let messages = vec![
            ChatMessage::text("user", "hi".into()),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(json!([{"function": {"name": "get_weather", "arguments": "{}"}}])),
                ..ChatMessage::default()
            },
        ];
        let p = t.render_with_tools(&messages, false, Some(&r.raw)).unwrap();
        assert_eq!(
            p,
            "<tools>get_weather;</tools>[user]hi[assistant]<call get_weather>"
        );
        let plain = ChatTemplate::new(
            Some("{% for m in messages %}{{ m.content }}{% endfor %}"),
            String::new(),
            String::new(),
        )
        .unwrap();
        assert!(!plain.knows_tools());
    }
}
