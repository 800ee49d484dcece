//! gRPC over turmoil's simulated TCP: the router's node channels connect through
//! [`SimConnector`], and the simulated nodes serve tonic on a turmoil listener ([`incoming`]).

use std::pin::Pin;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};

/// Opens node channels over the simulated network (`http://host:port`, host a turmoil name).
#[derive(Debug)]
pub struct SimConnector;

impl tandem_router::NodeConnector for SimConnector {
    fn connect_lazy(&self, endpoint: Endpoint) -> Result<Channel, String> {
        Ok(endpoint.connect_with_connector_lazy(tower::service_fn(|uri: Uri| async move {
            let host = uri.host().unwrap_or_default().to_string();
            let port = uri.port_u16().unwrap_or(80);
            let stream = turmoil::net::TcpStream::connect((host.as_str(), port)).await?;
            Ok::<_, std::io::Error>(TokioIo::new(stream))
        })))
    }
}

/// One accepted simulated connection, as tonic's server wants it.
pub struct Accepted(pub turmoil::net::TcpStream);

impl Connected for Accepted {
    type ConnectInfo = ();

    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for Accepted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

/// The connections a turmoil listener accepts, as a stream for `serve_with_incoming`.
pub fn incoming(
    listener: turmoil::net::TcpListener,
) -> impl futures_util::Stream<Item = std::io::Result<Accepted>> {
    futures_util::stream::unfold(listener, |listener| async move {
        let next = listener.accept().await.map(|(s, _)| Accepted(s));
        Some((next, listener))
    })
}
