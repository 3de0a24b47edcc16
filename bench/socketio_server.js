// The Socket.IO 4 peer of bench/socketio.py: websocket transport only, no compression.
// Answers every "hb" event with an acknowledgement carrying a 20-byte ACK (base64).
// Usage: NODE_PATH=<dir>/node_modules node socketio_server.js PORT
"use strict";
const http = require("http");
const { Server } = require("socket.io");

const port = Number(process.argv[2]);
const ACK = Buffer.alloc(20).toString("base64");
const httpServer = http.createServer();
const io = new Server(httpServer, {
  transports: ["websocket"],
  perMessageDeflate: false,
  httpCompression: false,
  serveClient: false,
  maxHttpBufferSize: 16384,
});
io.on("connection", (socket) => {
  socket.on("hb", (_frame, ack) => ack(ACK));
});
httpServer.listen(port, "127.0.0.1", 4096, () => console.error("listening"));
process.on("SIGTERM", () => process.exit(0));
