//! A minimal hyper server for `scripts/bench-http.sh`: it reads each
//! request's body and answers every request with the same one-byte body, on
//! a two-worker tokio runtime (what `fief node` has on the 2-core bench
//! machine), with keep-alive. It is the ceiling Fief's HTTP API is measured
//! against in the same run (issue 17: a call over HTTP ≥ 0.8× this).
//!
//! Usage: `hyper_fixed [ADDR]` (default `127.0.0.1:18081`).

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

fn main() {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18081".to_owned());
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .expect("binding the address");
        println!("hyper_fixed listening on http://{addr}");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let service = service_fn(|request: Request<Incoming>| async move {
                    let _ = request.into_body().collect().await;
                    Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"1"))))
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}
