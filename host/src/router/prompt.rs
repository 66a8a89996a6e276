//! A request's prompt → token ids → KV block hashes, for the policies that
//! read them (the `kv` policy's cache overlaps, `prefix-hash`'s key).
//!
//! * Token ids (a completions prompt given as ids) are used as they are.
//! * Text is tokenized with the Hugging Face `tokenizers` crate from the
//!   `tokenizer.json` given at start, with the tokenizer's special tokens
//!   added (as vLLM tokenizes a completions prompt).
//! * Chat messages are rendered with the Jinja chat template given at start
//!   (`messages`, `add_generation_prompt = true`, the request's `tools`,
//!   and `bos_token` / `eos_token` empty; Python string methods such as
//!   `strip()` work as in Hugging Face's renderer), then tokenized without
//!   adding special tokens (the template writes them).
//!
//! * Without a tokenizer, with
//!   [`text_as_bytes`](super::ServeConfig::text_as_bytes), text stands for
//!   its tokens [`BYTES_PER_TOKEN`] bytes at a time (chat messages rendered
//!   with the template when there is one, else their JSON as sent).
//!
//! Whole blocks of [`ServeConfig::block_size`](super::ServeConfig::block_size)
//! tokens are hashed with the KV index's [`KvBlockHasher`]; a partial last
//! block is not hashed. A prompt that cannot be turned into tokens is not
//! refused: it is routed by load, and the reason is counted
//! ([`Unhashed`], `selkie_unhashed_requests_total{reason}`).

use std::path::Path;

use minijinja::{Environment, Error as JinjaError, ErrorKind, Value};
use tokenizers::Tokenizer;

use super::error::ServeError;
use super::request::PromptInput;
use crate::kv_index::{sequence_hashes_of, KvBlockHasher};

/// The bytes of text that stand for one token when there is no tokenizer
/// ([`PromptHasher::with_text_as_bytes`]): about what English text averages
/// per token with the common subword tokenizers.
pub const BYTES_PER_TOKEN: usize = 4;

/// `text`'s bytes as token stand-ins, [`BYTES_PER_TOKEN`] to each (the
/// last zero-padded): two texts share exactly as many leading stand-ins
/// as they share whole leading pieces.
///
/// ```
/// use selkie::router::text_as_tokens;
/// assert_eq!(text_as_tokens("abcdef"), vec![u32::from_le_bytes(*b"abcd"), u32::from_le_bytes(*b"ef\0\0")]);
/// ```
pub fn text_as_tokens(text: &str) -> Vec<u32> {
    text.as_bytes()
        .chunks(BYTES_PER_TOKEN)
        .map(|piece| {
            let mut word = [0u8; BYTES_PER_TOKEN];
            word[..piece.len()].copy_from_slice(piece);
            u32::from_le_bytes(word)
        })
        .collect()
}

/// Why a request's prompt was not hashed (and so was routed by load).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Unhashed {
    /// A text prompt, and no `--tokenizer`.
    NoTokenizer,
    /// Chat messages, and no `--chat-template` (or no tokenizer).
    NoChatTemplate,
    /// The tokenizer failed on the text.
    TokenizerFailed,
    /// The chat template failed on the messages.
    TemplateFailed,
    /// Over `max_prompt_tokens` tokens or `max_tokenize_bytes` bytes.
    PromptTooLong,
    /// Several prompts in one request.
    BatchPrompt,
}

impl Unhashed {
    /// The label of `selkie_unhashed_requests_total{reason}`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Unhashed::NoTokenizer => "no_tokenizer",
            Unhashed::NoChatTemplate => "no_chat_template",
            Unhashed::TokenizerFailed => "tokenizer_failed",
            Unhashed::TemplateFailed => "template_failed",
            Unhashed::PromptTooLong => "prompt_too_long",
            Unhashed::BatchPrompt => "batch_prompt",
        }
    }

    /// Every reason, for metrics registered up front.
    pub const ALL: [Unhashed; 6] = [
        Unhashed::NoTokenizer,
        Unhashed::NoChatTemplate,
        Unhashed::TokenizerFailed,
        Unhashed::TemplateFailed,
        Unhashed::PromptTooLong,
        Unhashed::BatchPrompt,
    ];
}

/// A chat template, parsed once at start.
pub struct ChatTemplate {
    env: Environment<'static>,
}

/// The template's name inside its environment.
const TEMPLATE: &str = "chat";

impl ChatTemplate {
    /// Parses `source` (the text of a Jinja chat template).
    pub fn new(source: String) -> Result<Self, JinjaError> {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<Value, JinjaError> {
            Err(JinjaError::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned(TEMPLATE, source)?;
        Ok(ChatTemplate { env })
    }

    /// Reads and parses the template at `path`.
    pub fn from_file(path: &Path) -> Result<Self, ServeError> {
        let source = std::fs::read_to_string(path).map_err(|source| ServeError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::new(source).map_err(|e| ServeError::ChatTemplate {
            path: path.to_owned(),
            message: format!("{e:#}"),
        })
    }

    /// Renders `messages` (a JSON array) into the prompt text.
    ///
    /// ```
    /// use selkie::router::ChatTemplate;
    /// let t = ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{{ m.content.strip() }}\n{% endfor %}".into()).unwrap();
    /// let messages = serde_json::value::RawValue::from_string(r#"[{"role":"user","content":" hi "}]"#.into()).unwrap();
    /// assert_eq!(t.render(&messages).unwrap(), "<user>hi\n");
    /// ```
    pub fn render(&self, messages: &serde_json::value::RawValue) -> Result<String, JinjaError> {
        let messages: serde_json::Value = serde_json::from_str(messages.get())
            .map_err(|e| JinjaError::new(ErrorKind::BadSerialization, e.to_string()))?;
        let ctx = minijinja::context! {
            messages => Value::from(minijinja::value::Serde(&messages)),
            add_generation_prompt => true,
            bos_token => "",
            eos_token => "",
        };
        self.env.get_template(TEMPLATE)?.render(ctx)
    }
}

/// Prompts → tokens → block hashes, with the tokenizer, template and
/// bounds given at start.
pub struct PromptHasher {
    tokenizer: Option<Tokenizer>,
    template: Option<ChatTemplate>,
    hasher: KvBlockHasher,
    /// Blocks keyed by the engine's own hash chain instead (`--kv-hash
    /// engine-sha256-cbor`).
    engine_chain: Option<super::kv_events::Sha256CborChain>,
    max_prompt_tokens: usize,
    max_tokenize_bytes: usize,
    /// Without a tokenizer, text stands for its tokens
    /// [`BYTES_PER_TOKEN`] bytes at a time.
    text_as_bytes: bool,
}

/// A hashed prompt: its token count and its blocks' local and sequence
/// hashes (whole blocks only).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptBlocks {
    /// Tokens in the prompt.
    pub tokens: usize,
    /// Each whole block's own hash (the KV index's `tokens_hash`).
    pub local: Vec<u64>,
    /// Each whole block's hash chained over its prefix (the KV index's
    /// sequence hash: equal prefixes, equal hashes).
    pub sequence: Vec<u64>,
}

impl PromptHasher {
    /// A hasher of `block_size`-token blocks, with the optional tokenizer
    /// and chat template.
    pub fn new(
        block_size: u32,
        tokenizer: Option<Tokenizer>,
        template: Option<ChatTemplate>,
        max_prompt_tokens: usize,
        max_tokenize_bytes: usize,
    ) -> Self {
        PromptHasher {
            tokenizer,
            template,
            hasher: KvBlockHasher::new(block_size),
            engine_chain: None,
            max_prompt_tokens,
            max_tokenize_bytes,
            text_as_bytes: false,
        }
    }

    /// Without a tokenizer, text prompts and chat messages stand for their
    /// tokens [`BYTES_PER_TOKEN`] bytes at a time ([`text_as_tokens`]);
    /// chat messages are rendered with the template when there is one,
    /// else taken as their JSON. A tokenizer, when given, still decides.
    pub fn with_text_as_bytes(mut self) -> Self {
        self.text_as_bytes = true;
        self
    }

    /// Keys blocks by the engine's `sha256_cbor` chain (their `local`
    /// hashes are the engine's 64-bit block hashes).
    pub fn with_engine_chain(mut self, chain: super::kv_events::Sha256CborChain) -> Self {
        self.engine_chain = Some(chain);
        self
    }

    /// Tokens per block: the block hasher's and, with one, the engine hash
    /// chain's (the first that differs from `service`'s is refused by
    /// [`RouterCore::new`](super::RouterCore::new)).
    pub fn block_size(&self) -> u32 {
        self.hasher.block_size()
    }

    /// Refuses a hasher or an engine hash chain whose block size is not
    /// `service`'s.
    pub(crate) fn check_block_size(&self, service: u32) -> Result<(), ServeError> {
        let parts = [
            ("prompt hasher", Some(self.hasher.block_size())),
            ("engine hash chain", self.engine_chain.as_ref().map(|c| c.block_size())),
        ];
        for (part, size) in parts {
            if let Some(block_size) = size.filter(|&b| b != service) {
                return Err(ServeError::BlockSizeMismatch {
                    part,
                    block_size,
                    service,
                });
            }
        }
        Ok(())
    }

    /// Loads a tokenizer file.
    pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, ServeError> {
        Tokenizer::from_file(path).map_err(|e| ServeError::Tokenizer {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Whether hashing `prompt` means tokenizing text (the work a caller
    /// may move off an async runtime's threads when the text is long).
    pub fn text_bytes(&self, prompt: &PromptInput<'_>) -> usize {
        match prompt {
            PromptInput::Text(s) => s.len(),
            PromptInput::Chat(raw) => raw.get().len(),
            _ => 0,
        }
    }

    /// The prompt's token ids.
    pub fn tokens(&self, prompt: &PromptInput<'_>) -> Result<Vec<u32>, Unhashed> {
        let ids = match prompt {
            PromptInput::TokenIds(ids) => {
                if ids.len() > self.max_prompt_tokens {
                    return Err(Unhashed::PromptTooLong);
                }
                return Ok(ids.clone());
            }
            PromptInput::Batch(_) => return Err(Unhashed::BatchPrompt),
            PromptInput::Text(text) => {
                if self.tokenizer.is_none() && !self.text_as_bytes {
                    return Err(Unhashed::NoTokenizer);
                }
                if text.len() > self.max_tokenize_bytes {
                    return Err(Unhashed::PromptTooLong);
                }
                self.text_tokens(text, true)?
            }
            PromptInput::Chat(messages) => {
                if messages.get().len() > self.max_tokenize_bytes {
                    return Err(Unhashed::PromptTooLong);
                }
                let text = match (&self.template, self.tokenizer.is_some() || self.text_as_bytes) {
                    (Some(template), true) => {
                        let text = template.render(messages).map_err(|_| Unhashed::TemplateFailed)?;
                        if text.len() > self.max_tokenize_bytes {
                            return Err(Unhashed::PromptTooLong);
                        }
                        std::borrow::Cow::Owned(text)
                    }
                    (None, true) if self.tokenizer.is_none() => std::borrow::Cow::Borrowed(messages.get()),
                    _ => return Err(Unhashed::NoChatTemplate),
                };
                self.text_tokens(&text, false)?
            }
        };
        if ids.len() > self.max_prompt_tokens {
            return Err(Unhashed::PromptTooLong);
        }
        Ok(ids)
    }

    /// `text`'s tokens: the tokenizer's (with its special tokens added when
    /// `special`), or without one the text's bytes ([`text_as_tokens`]).
    fn text_tokens(&self, text: &str, special: bool) -> Result<Vec<u32>, Unhashed> {
        match &self.tokenizer {
            Some(tokenizer) => Ok(tokenizer
                .encode_fast(text, special)
                .map_err(|_| Unhashed::TokenizerFailed)?
                .get_ids()
                .to_vec()),
            None => Ok(text_as_tokens(text)),
        }
    }

    /// The prompt's blocks.
    pub fn blocks(&self, prompt: &PromptInput<'_>) -> Result<PromptBlocks, Unhashed> {
        let tokens = self.tokens(prompt)?;
        Ok(self.blocks_of(&tokens))
    }

    /// The blocks of `tokens`.
    pub fn blocks_of(&self, tokens: &[u32]) -> PromptBlocks {
        let mut out = PromptBlocks {
            tokens: tokens.len(),
            ..PromptBlocks::default()
        };
        match &self.engine_chain {
            Some(chain) => chain.block_hashes(tokens, &mut out.local),
            None => self.hasher.local_hashes(tokens, &mut out.local),
        }
        sequence_hashes_of(&out.local, &mut out.sequence);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::borrow::Cow;

    fn word_tokenizer() -> Tokenizer {
        use tokenizers::models::wordlevel::WordLevel;
        use tokenizers::pre_tokenizers::whitespace::Whitespace;
        let vocab = [("[UNK]", 0), ("hello", 1), ("world", 2), ("<user>", 3)]
            .into_iter()
            .map(|(w, i)| (w.to_string(), i))
            .collect();
        let model = WordLevel::builder()
            .vocab(vocab)
            .unk_token("[UNK]".into())
            .build()
            .unwrap();
        let mut t = Tokenizer::new(model);
        t.with_pre_tokenizer(Some(Whitespace {}));
        t
    }

    #[test]
    fn text_token_ids_and_chat_hash_alike() {
        let template = ChatTemplate::new("{% for m in messages %}{{ m.content }} {% endfor %}".into()).unwrap();
        let h = PromptHasher::new(2, Some(word_tokenizer()), Some(template), 100, 1000);
        let text = h
            .blocks(&PromptInput::Text(Cow::Borrowed("hello world hello x")))
            .unwrap();
        assert_eq!(text.tokens, 4);
        let ids = h.blocks(&PromptInput::TokenIds(vec![1, 2, 1, 0])).unwrap();
        assert_eq!(text, ids, "text and its token ids give the same blocks");
        let raw = serde_json::value::RawValue::from_string(
            r#"[{"role":"user","content":"hello world"},{"role":"user","content":"hello x"}]"#.into(),
        )
        .unwrap();
        let chat = h.blocks(&PromptInput::Chat(&raw)).unwrap();
        assert_eq!(chat, ids, "the rendered chat tokenizes to the same ids");
        assert_eq!(ids.local.len(), 2);
        assert_eq!(ids.sequence.len(), 2);
        assert_eq!(ids.sequence[0], ids.local[0]);
        assert_ne!(
            ids.sequence[1], ids.local[1],
            "the second block is chained to the first"
        );
    }

    #[test]
    fn unhashed_reasons() {
        let h = PromptHasher::new(16, None, None, 4, 10);
        assert_eq!(h.tokens(&PromptInput::Text("x".into())), Err(Unhashed::NoTokenizer));
        let raw = serde_json::value::RawValue::from_string("[]".into()).unwrap();
        assert_eq!(h.tokens(&PromptInput::Chat(&raw)), Err(Unhashed::NoChatTemplate));
        assert_eq!(h.tokens(&PromptInput::Batch(2)), Err(Unhashed::BatchPrompt));
        assert_eq!(
            h.tokens(&PromptInput::TokenIds(vec![1; 5])),
            Err(Unhashed::PromptTooLong)
        );
        let h = PromptHasher::new(16, Some(word_tokenizer()), None, 4, 10);
        assert_eq!(
            h.tokens(&PromptInput::Text("hello hello hello".into())),
            Err(Unhashed::PromptTooLong)
        );
        assert_eq!(h.tokens(&PromptInput::Text("hello".into())), Ok(vec![1]));
        let bad = ChatTemplate::new("{{ raise_exception('no system role') }}".into()).unwrap();
        let h = PromptHasher::new(16, Some(word_tokenizer()), Some(bad), 4, 100);
        assert_eq!(h.tokens(&PromptInput::Chat(&raw)), Err(Unhashed::TemplateFailed));
    }

    #[test]
    fn without_a_tokenizer_text_stands_for_its_tokens_four_bytes_at_a_time() {
        // Blocks of 2 stand-ins: 8 bytes of text.
        let h = PromptHasher::new(2, None, None, 100, 1000).with_text_as_bytes();
        let shared = "You are a helpful assistant. ";
        let a = h
            .blocks(&PromptInput::Text(format!("{shared}Tell me a joke.").into()))
            .unwrap();
        let b = h
            .blocks(&PromptInput::Text(format!("{shared}What is Rust?").into()))
            .unwrap();
        assert_eq!(a.tokens, (shared.len() + 15).div_ceil(BYTES_PER_TOKEN));
        // The 29 shared bytes are 3 whole blocks of 8; the fourth block
        // already holds bytes of their own.
        assert_eq!(a.sequence[..3], b.sequence[..3], "a shared prefix, shared blocks");
        assert_ne!(a.sequence[3], b.sequence[3]);
        assert_eq!(
            text_as_tokens("abcdefgh"),
            vec![u32::from_le_bytes(*b"abcd"), u32::from_le_bytes(*b"efgh")]
        );
        assert_eq!(text_as_tokens(""), Vec::<u32>::new());

        // Chat: rendered with the template when there is one, else its JSON.
        let raw =
            serde_json::value::RawValue::from_string(r#"[{"role":"user","content":"hello world"}]"#.into()).unwrap();
        assert_eq!(h.tokens(&PromptInput::Chat(&raw)), Ok(text_as_tokens(raw.get())));
        let template =
            ChatTemplate::new("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}".into()).unwrap();
        let h = PromptHasher::new(2, None, Some(template), 100, 1000).with_text_as_bytes();
        assert_eq!(
            h.tokens(&PromptInput::Chat(&raw)),
            Ok(text_as_tokens("<user>hello world"))
        );

        // The bounds hold; a tokenizer, when there is one, decides.
        let h = PromptHasher::new(2, None, None, 2, 1000).with_text_as_bytes();
        assert_eq!(
            h.tokens(&PromptInput::Text("123456789".into())),
            Err(Unhashed::PromptTooLong)
        );
        let h = PromptHasher::new(2, None, None, 100, 8).with_text_as_bytes();
        assert_eq!(
            h.tokens(&PromptInput::Text("123456789".into())),
            Err(Unhashed::PromptTooLong)
        );
        let h = PromptHasher::new(2, Some(word_tokenizer()), None, 100, 1000).with_text_as_bytes();
        assert_eq!(h.tokens(&PromptInput::Text("hello world".into())), Ok(vec![1, 2]));
    }
}
