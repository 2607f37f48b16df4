//! Sleeps 300 ms with std::thread::sleep, then sends how long it took in ms (Instant).
#[path = "../../guest_sdk/rust/symphony.rs"]
#[allow(dead_code)]
mod symphony;

fn main() {
    let started = std::time::Instant::now();
    std::thread::sleep(std::time::Duration::from_millis(300));
    symphony::send(started.elapsed().as_millis().to_string().as_bytes()).expect("send");
}
