//! An OpenAI request body → what routing needs from it: the model, the
//! prompt (text, token ids or chat messages), whether the response streams,
//! and the output bound. One parser for every front door.
//!
//! The body is parsed once, borrowing from its bytes: the fields routing
//! does not read (sampling parameters, tools, ...) are skipped, and the
//! chat messages are kept as raw JSON until a chat template needs them.
//! The body itself is forwarded unchanged; nothing here rewrites it.

use std::borrow::Cow;

use serde::Deserialize;
use serde_json::value::RawValue;

use super::error::{ApiError, Refusal};

/// The OpenAI endpoint a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// `POST /v1/completions`: a `prompt`.
    Completions,
    /// `POST /v1/chat/completions`: `messages`.
    ChatCompletions,
}

impl Endpoint {
    /// The path.
    pub const fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }

    /// The metrics label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Endpoint::Completions => "completions",
            Endpoint::ChatCompletions => "chat_completions",
        }
    }
}

/// A request's prompt as it came.
#[derive(Debug)]
pub enum PromptInput<'a> {
    /// A completions prompt given as text (or a list of one text).
    Text(Cow<'a, str>),
    /// A completions prompt given as token ids (or a list of one such
    /// list).
    TokenIds(Vec<u32>),
    /// A completions batch: several prompts in one request (`n` of them).
    /// Routed by load: one worker serves them all, and their blocks are not
    /// one prefix.
    Batch(usize),
    /// Chat messages, as raw JSON (rendered by the chat template when there
    /// is one).
    Chat(&'a RawValue),
}

impl PartialEq for PromptInput<'_> {
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (PromptInput::Text(a), PromptInput::Text(b)) => a == b,
            (PromptInput::TokenIds(a), PromptInput::TokenIds(b)) => a == b,
            (PromptInput::Batch(a), PromptInput::Batch(b)) => a == b,
            (PromptInput::Chat(a), PromptInput::Chat(b)) => a.get() == b.get(),
            _ => false,
        }
    }
}

impl PromptInput<'_> {
    /// The prompt's length in tokens as far as it is known without a
    /// tokenizer: exact for token ids, else an estimate (4 bytes a token).
    pub fn estimated_tokens(&self) -> usize {
        match self {
            PromptInput::TokenIds(t) => t.len(),
            PromptInput::Text(s) => s.len().div_ceil(4),
            PromptInput::Chat(raw) => raw.get().len().div_ceil(4),
            PromptInput::Batch(_) => 0,
        }
    }
}

/// What routing reads from a request body.
#[derive(Debug)]
pub struct ParsedRequest<'a> {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// `model`.
    pub model: Cow<'a, str>,
    /// The prompt.
    pub prompt: PromptInput<'a>,
    /// `stream`.
    pub stream: bool,
    /// `max_tokens` (or `max_completion_tokens`), if given.
    pub max_tokens: Option<u64>,
}

/// The fields read; serde skips the rest.
#[derive(Deserialize)]
struct Head<'a> {
    #[serde(borrow, default)]
    model: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    prompt: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<&'a RawValue>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
}

/// A prompt array: token ids, texts, or lists of token ids.
#[derive(Deserialize)]
#[serde(untagged)]
enum PromptArray<'a> {
    Tokens(Vec<u32>),
    #[serde(borrow)]
    Texts(Vec<Cow<'a, str>>),
    TokenLists(Vec<Vec<u32>>),
}

fn invalid(message: String) -> ApiError {
    ApiError::new(Refusal::InvalidField, message)
}

impl<'a> ParsedRequest<'a> {
    /// Parses `body` for `endpoint`.
    ///
    /// ```
    /// use selkie::router::{Endpoint, ParsedRequest, PromptInput, Refusal};
    /// let r = ParsedRequest::parse(Endpoint::Completions, br#"{"model":"m","prompt":[1,2,3],"stream":true}"#)?;
    /// assert_eq!((r.model.as_ref(), r.stream), ("m", true));
    /// assert_eq!(r.prompt, PromptInput::TokenIds(vec![1, 2, 3]));
    /// let e = ParsedRequest::parse(Endpoint::Completions, br#"{"prompt":"hi"}"#).unwrap_err();
    /// assert_eq!(e.reason, Refusal::MissingModel);
    /// # Ok::<(), selkie::router::ApiError>(())
    /// ```
    pub fn parse(endpoint: Endpoint, body: &'a [u8]) -> Result<Self, ApiError> {
        let head: Head<'a> = serde_json::from_slice(body).map_err(|e| {
            if e.is_data() {
                invalid(format!("the request body does not have the fields' types: {e}"))
            } else {
                ApiError::new(
                    Refusal::MalformedJson,
                    format!("the request body is not a JSON object: {e}"),
                )
            }
        })?;
        let model = head
            .model
            .filter(|m| !m.is_empty())
            .ok_or_else(|| ApiError::new(Refusal::MissingModel, "the request has no \"model\""))?;
        let prompt = match endpoint {
            Endpoint::Completions => {
                let raw = head
                    .prompt
                    .filter(|p| p.get() != "null")
                    .ok_or_else(|| ApiError::new(Refusal::MissingPrompt, "the request has no \"prompt\""))?;
                completions_prompt(raw)?
            }
            Endpoint::ChatCompletions => {
                let raw = head
                    .messages
                    .filter(|p| p.get() != "null")
                    .ok_or_else(|| ApiError::new(Refusal::MissingPrompt, "the request has no \"messages\""))?;
                if !raw.get().starts_with('[') {
                    return Err(invalid("\"messages\" must be an array".into()));
                }
                PromptInput::Chat(raw)
            }
        };
        Ok(ParsedRequest {
            endpoint,
            model,
            prompt,
            stream: head.stream.unwrap_or(false),
            max_tokens: head.max_tokens.or(head.max_completion_tokens),
        })
    }
}

fn completions_prompt(raw: &RawValue) -> Result<PromptInput<'_>, ApiError> {
    let text = raw.get();
    let shape = || {
        invalid("\"prompt\" must be a string, an array of strings, an array of token ids (0 ..= 2^32-1) or an array of such arrays".into())
    };
    match text.as_bytes().first() {
        Some(b'"') => {
            let s: Cow<'_, str> = serde_json::from_str(text).map_err(|_| shape())?;
            Ok(PromptInput::Text(s))
        }
        Some(b'[') => match serde_json::from_str::<PromptArray<'_>>(text).map_err(|_| shape())? {
            PromptArray::Tokens(t) => Ok(PromptInput::TokenIds(t)),
            PromptArray::Texts(mut v) if v.len() == 1 => Ok(PromptInput::Text(v.remove(0))),
            PromptArray::TokenLists(mut v) if v.len() == 1 => Ok(PromptInput::TokenIds(v.remove(0))),
            PromptArray::Texts(v) if v.is_empty() => Err(ApiError::new(Refusal::MissingPrompt, "\"prompt\" is empty")),
            PromptArray::Texts(v) => Ok(PromptInput::Batch(v.len())),
            PromptArray::TokenLists(v) => Ok(PromptInput::Batch(v.len())),
        },
        _ => Err(shape()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<ParsedRequest<'_>, ApiError> {
        ParsedRequest::parse(endpoint, body.as_bytes())
    }

    #[test]
    fn prompts_of_every_shape() {
        let c = Endpoint::Completions;
        let text = |b| parse(c, b).unwrap().prompt;
        assert_eq!(
            text(r#"{"model":"m","prompt":"hello"}"#),
            PromptInput::Text("hello".into())
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":["hello"]}"#),
            PromptInput::Text("hello".into())
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":"a\nb"}"#),
            PromptInput::Text("a\nb".into())
        );
        assert_eq!(
            text(r#"{"model":"m","prompt":[[5,6]]}"#),
            PromptInput::TokenIds(vec![5, 6])
        );
        assert_eq!(text(r#"{"model":"m","prompt":[]}"#), PromptInput::TokenIds(vec![]));
        assert_eq!(text(r#"{"model":"m","prompt":["a","b"]}"#), PromptInput::Batch(2));
        assert_eq!(text(r#"{"model":"m","prompt":[[1],[2],[3]]}"#), PromptInput::Batch(3));
        let chat = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        );
        assert!(matches!(chat.unwrap().prompt, PromptInput::Chat(_)));
    }

    #[test]
    fn refusals_name_what_is_wrong() {
        let c = Endpoint::Completions;
        let reason = |b| parse(c, b).unwrap_err().reason;
        assert_eq!(reason("{"), Refusal::MalformedJson);
        assert_eq!(reason("[1,2]"), Refusal::InvalidField);
        assert_eq!(reason("not json"), Refusal::MalformedJson);
        assert_eq!(reason(r#"{"prompt":"x"}"#), Refusal::MissingModel);
        assert_eq!(reason(r#"{"model":"","prompt":"x"}"#), Refusal::MissingModel);
        assert_eq!(reason(r#"{"model":"m"}"#), Refusal::MissingPrompt);
        assert_eq!(reason(r#"{"model":"m","prompt":null}"#), Refusal::MissingPrompt);
        assert_eq!(reason(r#"{"model":"m","prompt":5}"#), Refusal::InvalidField);
        assert_eq!(reason(r#"{"model":"m","prompt":[-1]}"#), Refusal::InvalidField);
        assert_eq!(
            reason(r#"{"model":"m","prompt":"x","stream":"yes"}"#),
            Refusal::InvalidField
        );
        assert_eq!(reason(r#"{"model":7,"prompt":"x"}"#), Refusal::InvalidField);
        let chat = |b| parse(Endpoint::ChatCompletions, b).unwrap_err().reason;
        assert_eq!(chat(r#"{"model":"m","prompt":"x"}"#), Refusal::MissingPrompt);
        assert_eq!(chat(r#"{"model":"m","messages":"x"}"#), Refusal::InvalidField);
    }

    #[test]
    fn stream_and_output_bound() {
        let r = parse(
            Endpoint::Completions,
            r#"{"model":"m","prompt":"x","stream":true,"max_tokens":7}"#,
        )
        .unwrap();
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(7));
        let r = parse(
            Endpoint::ChatCompletions,
            r#"{"model":"m","messages":[],"max_completion_tokens":9}"#,
        )
        .unwrap();
        assert!(!r.stream);
        assert_eq!(r.max_tokens, Some(9));
    }
}
