//! Chat prompts: the model's Jinja `chat_template` rendered with minijinja,
//! or a documented plain format when the model has none.
//!
//! The template is compiled once at startup ([`ChatTemplate::new`]), so a
//! template minijinja cannot parse is a startup error, not a 500 on every
//! chat request. Rendering follows Hugging Face `transformers`: blocks are
//! trimmed (`trim_blocks`, `lstrip_blocks`), the context has `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token`, and the template may
//! call `raise_exception(msg)` (that becomes a 400 naming `messages`). The
//! Python string and dict methods templates commonly call (`strip`,
//! `startswith`, `split`, `items`, `get`, …) are provided.
//!
//! # Plain fallback
//! Without a template each message becomes `"{Role}: {content}\n\n"` (role
//! capitalized: `System`, `User`, `Assistant`, `Tool`, `Developer`), and the
//! generation prompt is `"Assistant:"`. The tokenizer adds BOS as for any
//! prompt.

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};
use serde::Serialize;

use super::errors::ApiError;
use crate::tokenizer::Tokenizer;

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message, content flattened to text.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// An assistant message's `tool_calls`, as the client sent them (for
    /// templates that render them; see `tools.rs`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A tool message's `tool_call_id`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    /// A message with text only.
    pub fn text(role: &str, content: String) -> Self {
        Self {
            role: role.to_string(),
            content,
            ..Self::default()
        }
    }
}

/// A template that does not compile.
#[derive(Debug, thiserror::Error)]
#[error("the model's chat_template does not compile: {0:#}")]
pub struct TemplateError(#[from] Error);

/// Renders chat messages into a prompt. Cheap to share (`Send + Sync`).
pub struct ChatTemplate {
    /// `None`: the plain fallback.
    env: Option<Environment<'static>>,
    /// The template's source mentions `tools`: it renders them itself.
    knows_tools: bool,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("has_template", &self.env.is_some())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

#[derive(Serialize)]
struct Context<'a> {
    messages: &'a [ChatMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
    /// Hugging Face's `tools` (absent when the request has none).
    #[serde(skip_serializing_if = "Option::is_none")]
    tools: Option<&'a serde_json::Value>,
}

impl ChatTemplate {
    /// The tokenizer's template (or the fallback when it has none).
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Self, TemplateError> {
        let literal = |id: Option<u32>| {
            id.and_then(|id| tokenizer.inner().id_to_token(id))
                .unwrap_or_default()
        };
        Self::new(
            tokenizer.chat_template(),
            literal(tokenizer.bos_id()),
            literal(tokenizer.eos_ids().first().copied()),
        )
    }

    /// Compiles `source` (or selects the fallback for `None`).
    pub fn new(
        source: Option<&str>,
        bos_token: String,
        eos_token: String,
    ) -> Result<Self, TemplateError> {
        let env = match source {
            None => None,
            Some(src) => {
                let mut env = Environment::new();
                env.set_trim_blocks(true);
                env.set_lstrip_blocks(true);
                env.add_function("raise_exception", raise_exception);
                env.set_unknown_method_callback(python_methods);
                env.add_template_owned(TEMPLATE_NAME, src.to_string())?;
                Some(env)
            }
        };
        Ok(Self {
            env,
            knows_tools: source.is_some_and(|s| s.contains("tools")),
            bos_token,
            eos_token,
        })
    }

    /// Whether the model brought its own template.
    pub fn has_template(&self) -> bool {
        self.env.is_some()
    }

    /// Whether the template renders `tools` itself (Hermes, Qwen, Llama
    /// 3.1 templates); otherwise tool calling uses the generic format.
    pub fn knows_tools(&self) -> bool {
        self.knows_tools
    }

    /// The prompt for `messages`, ending with the assistant's cue when
    /// `add_generation_prompt` is set.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ApiError> {
        self.render_with_tools(messages, add_generation_prompt, None)
    }

    /// [`render`](Self::render) with the request's `tools` in the context.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&serde_json::Value>,
    ) -> Result<String, ApiError> {
        let Some(env) = &self.env else {
            return Ok(plain(messages, add_generation_prompt));
        };
        let ctx = Context {
            messages,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
            tools,
        };
        env.get_template(TEMPLATE_NAME)
            .and_then(|t| t.render(&ctx))
            .map_err(|e| match e.kind() {
                // `raise_exception` is the template refusing the conversation.
                ErrorKind::InvalidOperation => ApiError::invalid_field(
                    "messages",
                    format!(
                        "rejected by the model's chat template: {}",
                        e.detail().unwrap_or("")
                    ),
                ),
                _ => ApiError::internal(format!("rendering the chat template failed: {e:#}")),
            })
    }
}

/// The documented fallback format.
fn plain(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut out = String::new();
    for m in messages {
        let mut role = m.role.chars();
        if let Some(first) = role.next() {
            out.extend(first.to_uppercase());
            out.push_str(role.as_str());
        }
        out.push_str(": ");
        out.push_str(&m.content);
        out.push_str("\n\n");
    }
    if add_generation_prompt {
        out.push_str("Assistant:");
    }
    out
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// The Python `str` and `dict` methods chat templates call, which minijinja
/// does not have built in.
fn python_methods(
    state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, Error> {
    let arg_str = |i: usize| args.get(i).and_then(Value::as_str);
    if let Some(s) = value.as_str() {
        let chars = arg_str(0);
        let trim_set = |c: char| chars.map_or(c.is_whitespace(), |set| set.contains(c));
        return Ok(match method {
            "strip" => Value::from(s.trim_matches(trim_set)),
            "lstrip" => Value::from(s.trim_start_matches(trim_set)),
            "rstrip" => Value::from(s.trim_end_matches(trim_set)),
            "startswith" => Value::from(arg_str(0).is_some_and(|p| s.starts_with(p))),
            "endswith" => Value::from(arg_str(0).is_some_and(|p| s.ends_with(p))),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" => state.apply_filter("title", std::slice::from_ref(value))?,
            "replace" => match (arg_str(0), arg_str(1)) {
                (Some(from), Some(to)) => Value::from(s.replace(from, to)),
                _ => return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)")),
            },
            "split" => Value::from(match arg_str(0) {
                Some(sep) => s.split(sep).map(str::to_string).collect::<Vec<_>>(),
                None => s.split_whitespace().map(str::to_string).collect(),
            }),
            _ => return Err(Error::from(ErrorKind::UnknownMethod)),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => state.apply_filter("items", std::slice::from_ref(value)),
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => Ok(Value::from(
                value
                    .try_iter()?
                    .map(|k| value.get_item(&k))
                    .collect::<Result<Vec<_>, _>>()?,
            )),
            "get" => {
                let key = args.first().cloned().unwrap_or_default();
                let found = value.get_item(&key)?;
                Ok(if found.is_undefined() {
                    args.get(1).cloned().unwrap_or(Value::from(()))
                } else {
                    found
                })
            }
            _ => Err(Error::from(ErrorKind::UnknownMethod)),
        };
    }
    Err(Error::from(ErrorKind::UnknownMethod))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage {
                role: r.to_string(),
                content: c.to_string(),
                ..ChatMessage::default()
            })
            .collect()
    }

    #[test]
    fn plain_fallback() {
        let t = ChatTemplate::new(None, "<s>".into(), "</s>".into()).unwrap();
        let p = t
            .render(&msgs(&[("system", "be brief"), ("user", "hi")]), true)
            .unwrap();
        assert_eq!(p, "System: be brief\n\nUser: hi\n\nAssistant:");
        assert!(!t.has_template());
    }

    #[test]
    fn renders_a_hugging_face_style_template() {
        // The shape of Zephyr/ChatML-like templates, with the Python methods
        // and variables real ones use.
        let src = "{{ bos_token }}{% for message in messages %}\n\
            {% if message['role'] == 'tool' %}{{ raise_exception('no tools') }}{% endif %}\n\
            <|{{ message['role'] }}|>\n{{ message['content'].strip() }}{{ eos_token }}\n\
            {% endfor %}\n\
            {% if add_generation_prompt %}<|assistant|>\n{% endif %}";
        let t = ChatTemplate::new(Some(src), "<s>".into(), "</s>".into()).unwrap();
        let p = t.render(&msgs(&[("user", "  hi  ")]), true).unwrap();
        assert_eq!(p, "<s><|user|>\nhi</s>\n<|assistant|>\n");
        let e = t.render(&msgs(&[("tool", "x")]), true).unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.param.as_deref()),
            (400, Some("messages"))
        );
        assert!(e.message.contains("no tools"), "{}", e.message);
    }

    #[test]
    fn python_methods_work() {
        let src = "{{ 'a,b'.split(',') | join('+') }} {{ 'xx'.startswith('x') }} \
            {{ {'k': 1}.get('k') }} {{ {'k': 1}.get('z', 7) }} {{ '..a..'.strip('.') }}";
        let t = ChatTemplate::new(Some(src), String::new(), String::new()).unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "a+b True 1 7 a");
    }

    #[test]
    fn a_broken_template_fails_at_startup() {
        assert!(ChatTemplate::new(Some("{% for %}"), String::new(), String::new()).is_err());
    }
}
