//! Streams its argument's tokens through the SDK's TextStream, one more token each time: what
//! it sends, joined, must be the argument itself (a character may span tokens).
#[path = "../../guest_sdk/rust/symphony.rs"]
#[allow(dead_code)]
mod symphony;

fn main() {
    let text = std::env::args().nth(1).unwrap_or_default();
    let ids = symphony::tokenize(&text, false).expect("tokenize");
    let mut stream = symphony::TextStream::new();
    for end in 1..=ids.len() {
        stream.update(&ids[..end]).expect("send");
    }
}
