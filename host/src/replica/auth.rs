//! Message signatures: an HMAC-SHA256, with the key the replicas of one
//! partition share, over the subject and the message's bytes.
//!
//! The signature travels in the NATS header [`SIGNATURE_HEADER`], as 64
//! lowercase hex digits, so that the signed bytes are exactly the payload
//! the receiver gets. The subject is signed too: a message signed for one
//! partition is refused on another's subject even where both share a key.
//! A receiver with a key checks the signature (in constant time) before it
//! decodes anything; a receiver without one ignores the header.
//!
//! What it must not do: show the key (its `Debug` does not), or accept a
//! message whose signature it did not check.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The NATS header a signed message carries its signature in.
pub(crate) const SIGNATURE_HEADER: &str = "Selkie-Signature";

/// The fewest bytes a signing key may have.
pub(crate) const MIN_KEY_BYTES: usize = 16;

/// A partition's signing key, ready to sign (the HMAC's keyed state, cloned
/// per message).
#[derive(Clone)]
pub(crate) struct SigningKey {
    keyed: Hmac<Sha256>,
    len: usize,
}

/// Why a message's signature was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BadSignature {
    /// No signature header.
    Missing,
    /// A signature that is not this key's over these bytes.
    Wrong,
}

impl SigningKey {
    /// `None` for a key shorter than [`MIN_KEY_BYTES`].
    pub(crate) fn new(key: &[u8]) -> Option<SigningKey> {
        if key.len() < MIN_KEY_BYTES {
            return None;
        }
        let keyed = <Hmac<Sha256> as KeyInit>::new_from_slice(key).ok()?;
        Some(SigningKey { keyed, len: key.len() })
    }

    fn mac(&self, subject: &str, payload: &[u8]) -> Hmac<Sha256> {
        let mut mac = self.keyed.clone();
        mac.update(&(subject.len() as u64).to_be_bytes());
        mac.update(subject.as_bytes());
        mac.update(payload);
        mac
    }

    /// The signature of `payload` on `subject`, as the header carries it.
    pub(crate) fn sign(&self, subject: &str, payload: &[u8]) -> String {
        let tag = self.mac(subject, payload).finalize().into_bytes();
        let mut hex = String::with_capacity(2 * tag.len());
        for byte in tag {
            hex.push(char::from(HEX[usize::from(byte >> 4)]));
            hex.push(char::from(HEX[usize::from(byte & 0xf)]));
        }
        hex
    }

    /// Checks the signature header's value (`None`: the message had none).
    pub(crate) fn verify(&self, subject: &str, payload: &[u8], signature: Option<&str>) -> Result<(), BadSignature> {
        let signature = signature.ok_or(BadSignature::Missing)?;
        let tag = decode_hex(signature).ok_or(BadSignature::Wrong)?;
        self.mac(subject, payload)
            .verify_slice(&tag)
            .map_err(|_| BadSignature::Wrong)
    }
}

impl std::fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SigningKey({} bytes, redacted)", self.len)
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// The 32 bytes 64 hex digits spell, or `None`.
fn decode_hex(hex: &str) -> Option<[u8; 32]> {
    let digits = hex.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let nibble = |d: u8| char::from(d).to_digit(16).map(|n| n as u8);
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_checks_only_for_its_key_subject_and_bytes() {
        let key = SigningKey::new(b"0123456789abcdef0123").unwrap();
        let sig = key.sign("selkie.a", b"{\"r\":1}");
        assert_eq!(sig.len(), 64);
        assert_eq!(key.verify("selkie.a", b"{\"r\":1}", Some(&sig)), Ok(()));
        assert_eq!(
            key.verify("selkie.a", b"{\"r\":2}", Some(&sig)),
            Err(BadSignature::Wrong)
        );
        assert_eq!(
            key.verify("selkie.b", b"{\"r\":1}", Some(&sig)),
            Err(BadSignature::Wrong)
        );
        assert_eq!(key.verify("selkie.a", b"{\"r\":1}", None), Err(BadSignature::Missing));
        assert_eq!(
            key.verify("selkie.a", b"{\"r\":1}", Some("zz")),
            Err(BadSignature::Wrong)
        );
        assert_eq!(
            key.verify("selkie.a", b"{\"r\":1}", Some(&sig.to_uppercase())),
            Ok(()),
            "hex digits of either case"
        );
        let other = SigningKey::new(b"0123456789abcdef0124").unwrap();
        assert_eq!(
            other.verify("selkie.a", b"{\"r\":1}", Some(&sig)),
            Err(BadSignature::Wrong)
        );
        // The subject's length is signed: no shifting bytes between the two.
        assert_ne!(key.sign("a.b", b"c"), key.sign("a", b".bc"));
        assert!(SigningKey::new(&[7; MIN_KEY_BYTES - 1]).is_none());
        assert!(!format!("{key:?}").contains("0123"), "the key is not shown");
    }
}
