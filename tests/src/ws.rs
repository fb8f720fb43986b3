//! A WebSocket client of a node's `GET /v1/keys/{module}/{key}/connect`
//! (tokio-tungstenite), for the tests of connections to keys: connect, and
//! read the next text frame or close frame with a deadline.

use std::time::Duration;

use futures_util::StreamExt;
use tokio::net::TcpStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// A connected client.
pub type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// The `ws://` URL of `module`/`key` on the node whose API is at `base`
/// (`http://127.0.0.1:<port>`).
pub fn url(base: &str, module: &str, key: &str) -> String {
    format!("{base}/v1/keys/{module}/{key}/connect").replacen("http://", "ws://", 1)
}

/// Connect to `module`/`key` on the node whose API is at `base`; panics,
/// naming the key, if the node refuses.
pub async fn connect(base: &str, module: &str, key: &str) -> Client {
    let (client, _) = tokio_tungstenite::connect_async(url(base, module, key))
        .await
        .unwrap_or_else(|e| panic!("connecting to {module}/{key}: {e}"));
    client
}

/// The next text frame (pings skipped), within `patience`.
pub async fn next_text(client: &mut Client, patience: Duration) -> String {
    loop {
        let frame = tokio::time::timeout(patience, client.next())
            .await
            .expect("a frame within the patience")
            .expect("the connection is open")
            .expect("a frame, not an error");
        match frame {
            Message::Text(text) => return text.to_string(),
            Message::Ping(_) | Message::Pong(_) => {}
            other => panic!("expected a text frame, got {other:?}"),
        }
    }
}

/// The close frame the client gets next (other frames before it skipped),
/// within `patience`; `None` if the connection ended without one.
pub async fn next_close(client: &mut Client, patience: Duration) -> Option<CloseFrame> {
    loop {
        match tokio::time::timeout(patience, client.next()).await {
            Ok(Some(Ok(Message::Close(frame)))) => return frame,
            Ok(Some(Ok(_))) => {}
            Ok(Some(Err(e))) => panic!("the connection failed instead of closing: {e}"),
            Ok(None) => return None,
            Err(_) => panic!("no close within {patience:?}"),
        }
    }
}
