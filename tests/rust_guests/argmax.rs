//! Reads float32 arrays from recv (one per message) and sends back the SDK's argmax of each as text.
#[path = "../../guest_sdk/rust/symphony.rs"]
#[allow(dead_code)]
mod symphony;

fn main() {
    while let Some(bytes) = symphony::recv().expect("recv") {
        let values: Vec<f32> =
            bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        symphony::send_str(&format!("{}\n", symphony::argmax(&values))).expect("send");
    }
}
