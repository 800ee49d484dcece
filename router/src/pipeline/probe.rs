//! The canary's rounds (see [`crate::canary`] for the policy): probes run through the same
//! attempt code as client requests, pinned to one (prefill, decode) pair and not counted as
//! client traffic.

use std::time::{Duration, Instant};

use tandem_cluster::NodeView;
use tandem_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::attempt::AttemptState;
use super::{Router, WeakRouter};
use crate::canary::{self, round_pairs};
use crate::error::RouterError;
use crate::request::{PreparedRequest, Priority};

/// Runs a round every `interval`, and shortly after membership changes, until `shutdown`
/// fires or the router is dropped.
pub(super) async fn canary_loop(
    router: WeakRouter,
    mut prefill: watch::Receiver<NodeView>,
    mut decode: watch::Receiver<NodeView>,
    shutdown: CancellationToken,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
            r = prefill.changed() => {
                if r.is_err() { return }
                tokio::time::sleep(canary::MEMBERSHIP_DEBOUNCE).await;
            }
            r = decode.changed() => {
                if r.is_err() { return }
                tokio::time::sleep(canary::MEMBERSHIP_DEBOUNCE).await;
            }
        }
        let Some(router) = router.upgrade() else {
            return;
        };
        router.canary_round().await;
    }
}

impl Router {
    /// Probes this round's pairs, one at a time, and updates health and routing.
    pub async fn canary_round(&self) {
        let inner = &self.inner;
        let settings = inner.options.canary;
        let (prefill, decode) = (inner.prefill.accepting_ids(), inner.decode.accepting_ids());
        let round = self.canary_state().rounds();
        let pairs = round_pairs(&prefill, &decode, round, settings.max_pairs);
        for (n, (p, d)) in pairs.iter().enumerate() {
            let started = Instant::now();
            let span = tracing::info_span!(
                "router.canary",
                tandem.prefill_node = %p,
                tandem.decode_node = %d,
                tandem.round = round,
            );
            let outcome =
                tokio::time::timeout(settings.timeout, self.probe(p, d, round, n).instrument(span.clone()))
                    .await;
            let timed_out = outcome.is_err();
            let result = match outcome {
                Ok(Ok(())) => Ok(started.elapsed()),
                Ok(Err(e)) => Err(format!("{}: {e}", e.kind())),
                Err(_) => Err(format!("timeout: no answer within {:?}", settings.timeout)),
            };
            if timed_out
                && canary::timeout_is_inconclusive(
                    inner.prefill.fresh_report(p).as_ref(),
                    inner.decode.fresh_report(d).as_ref(),
                )
            {
                // Queued behind real work that is making progress: no verdict on the pair.
                tracing::debug!(prefill = %p, decode = %d, "canary probe timed out behind real work; inconclusive");
                inner.metrics.canary_inconclusive();
                continue;
            }
            if let Err(e) = &result {
                tandem_telemetry::trace::propagation::mark_error(&span, "canary_failed", e);
                tracing::debug!(prefill = %p, decode = %d, error = %e, "canary probe failed");
            }
            inner.metrics.canary_probe(result.is_ok(), started.elapsed());
            inner
                .canary
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .record(p, d, result, settings.failures_to_quarantine);
        }
        let (quarantined_p, quarantined_d) = {
            let mut state = inner.canary.lock().unwrap_or_else(|e| e.into_inner());
            let before = state.counts();
            state.retain_nodes(
                &inner.prefill.registered_ids(),
                &inner.decode.registered_ids(),
            );
            state.round_done();
            let after = state.counts();
            if before.1 > 0 && after.1 == 0 && after.0 > 0 {
                tracing::error!(pairs = after.0, "canary: no prefill→decode pair passes; health is NOT_SERVING");
            }
            state.quarantined()
        };
        inner.prefill.set_quarantined(quarantined_p);
        inner.decode.set_quarantined(quarantined_d);
        inner.canary_rounds.send_modify(|n| *n += 1);
    }

    /// One greedy two-token generation through exactly (`prefill`, `decode`).
    async fn probe(
        &self,
        prefill: &str,
        decode: &str,
        round: u64,
        n: usize,
    ) -> Result<(), RouterError> {
        let inner = &self.inner;
        let request = PreparedRequest {
            request_id: format!("canary-{}-{round}-{n}", inner.id_prefix),
            prompt_ids: inner.canary_prompt.clone(),
            sampling: pb::SamplingParams {
                max_tokens: 2,
                ignore_eos: true,
                ..Default::default()
            },
            priority: Priority::Interactive,
        };
        // Room for every event: nobody reads them.
        let (events, _rx) = mpsc::channel(8);
        let mut state = AttemptState::new(
            inner,
            &request,
            &events,
            Instant::now(),
            tracing::Span::current(),
        );
        state.pin = Some((prefill.to_string(), decode.to_string()));
        state.counted = false;
        state.run().await?;
        if state.tokens_sent() == 0 {
            return Err(RouterError::PipelineLost);
        }
        Ok(())
    }
}

