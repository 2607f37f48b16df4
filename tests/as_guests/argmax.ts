// Reads float32 arrays from recv (one per message) and sends back the SDK's argmax of each as text.
import { argmax, recv, sendText } from "../../guest_sdk/assemblyscript/symphony";

const buffer = new ArrayBuffer(1 << 18);
for (;;) {
  const n = recv(changetype<usize>(buffer), buffer.byteLength);
  if (n < 0) break;
  sendText(argmax(Float32Array.wrap(buffer, 0, n / 4)).toString() + "\n");
}
