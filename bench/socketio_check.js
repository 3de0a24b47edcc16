// One emit-with-ack through the official socket.io-client, to check that the server
// of socketio_server.js works as Socket.IO users would see it before it is measured.
// Usage: NODE_PATH=<dir>/node_modules node socketio_check.js PORT
"use strict";
const { io } = require("socket.io-client");

const socket = io(`http://127.0.0.1:${process.argv[2]}`, { transports: ["websocket"] });
const timer = setTimeout(() => {
  console.log("no acknowledgement within 10 s");
  process.exit(1);
}, 10000);
socket.on("connect_error", (err) => {
  console.log(`connect error: ${err.message}`);
  process.exit(1);
});
socket.on("connect", () => {
  socket.emit("hb", "check", (reply) => {
    clearTimeout(timer);
    console.log(`ok: ack of ${reply.length} characters`);
    socket.close();
    process.exit(0);
  });
});
