"""The background thread: one selector loop over the coordinator's connection, the peers'
and the wake-up socket, its timeouts, shutdown, and failing everything pending when the job
fails.
"""
from __future__ import annotations

import logging
import threading
import time

from .. import interrupts, rendezvous
from ..flight_recorder import RECORDER
from ..protocol import Msg
from ..wire import ProtocolError
from . import windows

log = logging.getLogger("hvdlite.common.engine")


class BackgroundLoop:
    """Part of engine.core.Engine: the loop (this module's docstring)."""

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._closed is not None:
            # The job failed: nothing pending will complete (_close failed it all), so
            # transfers still waited for end now, not at the transport's timeout, and the
            # threads joined below are not held by them (backends/mpi.MPICommunicator.abandon).
            for comm in list(self.comms.values()):
                comm.abandon()
        self._stopping = True
        self._wake()
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
            self.finisher.join(timeout)
            waiter = self._waiter
            if waiter is not None:        # stopped by the background thread as it ended
                waiter.stop()
                waiter.join(timeout)
        for comm in self.comms.values():
            comm.close()
        self.comms.clear()
        interrupts.unwrap()               # (the signal handlers _read_peers wrapped)

    # ------------------------------------------------------------------ background thread
    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:  # never leave a caller waiting on a dead thread
            log.exception("hvdlite background thread failed")
            self._close(f"hvdlite background thread failed on rank {self.rank}: {exc!r}")
        finally:
            if self._waiter is not None:
                self._waiter.stop()
            self._transport.put(None)
            # Closing the channel tells the coordinator this rank is gone (a crash, unless SHUTDOWN
            # was sent first).
            self.channel.close()
            self._close_peer_sockets()
            try:
                self._sel.close()
                self._wake_r.close()
                self._wake_w.close()
            except OSError:
                pass

    def _loop(self) -> None:
        while True:
            with self._drive:
                if self._stopping:
                    self._finish_shutdown()
                    return
                timeout = self._next_timeout()
            events = self._sel.select(timeout)
            with self._drive:
                if not self._step(events):
                    return

    def _next_timeout(self) -> float:
        """How long the background thread may sleep in select(); sends what is due first."""
        timeout = 0.5
        if self._queue:
            left = self.cycle_s - (time.monotonic() - self._last_send)
            # The cycle time batches tensors that arrive while earlier ones are still being
            # negotiated or reduced; with nothing outstanding, waiting only adds latency.
            if left <= 0 or (len(self._inflight) == len(self._queue)
                             and not self._in_transport):
                self._send_queued()
            else:
                timeout = left
        if self.steady:
            timeout = min(timeout, self._steady_timeout())
        if self.steady and self.buckets.enabled:
            # Callers hold entries without waking this thread (enqueue): look at least this
            # often, so a hold's deadline (>= MIN_HOLD_S) is late by at most as much.
            timeout = min(timeout, self.buckets.MIN_HOLD_S)
        with self._lock:
            if self._held:
                timeout = max(0.0, min(timeout,
                                       min(h[3] for h in self._held) - time.monotonic()))
        return timeout

    def _step(self, events) -> bool:
        """Completion what select() reported, then whatever is due; False once the engine ends."""
        eof = False
        for key, _ in events:
            if key.data == "wake":
                try:
                    self._wake_r.recv(65536)
                except BlockingIOError:
                    pass
                # Cleared after the read, never before: a byte sent in between stays for the
                # next select() (one spurious wake-up), while clearing first could leave the flag
                # set with no byte on its way, and _wake would then skip a needed wake-up.
                self._wake_pending = False
            elif key.data == "listen":
                self._accept_peer()
            elif key.data != "hub":
                self._on_peer_readable(key.data)
                if self._closed is not None:
                    return False
            else:
                try:
                    eof = not self.channel.feed()
                    self._last_heard = time.monotonic()
                except OSError:
                    eof = True
        if self._silence_limit_s and not eof and \
                time.monotonic() - self._last_heard > self._silence_limit_s:
            silent = time.monotonic() - self._last_heard
            rendezvous.report_hung([0])
            self._close(f"rank 0 (the coordinator) has sent nothing for {silent:.0f} s, "
                        f"more than the stall shutdown time + 10 s: it is hung (stopped) "
                        f"or its host is unreachable. {windows.SHUT_DOWN_MESSAGE}")
            return False
        try:
            msgs = self.channel.messages()
        except ProtocolError as exc:
            self._close(f"rank {self.rank}: {exc}")
            return False
        for msg in msgs:
            if not self._on_message(msg):
                return False
        if self._held:
            self._release_held()
        if self.steady:
            for st in list(self.steady.values()):
                self._steady_kick(st)      # rounds held back while another released
            self._steady_reports()
        if eof:
            self._close(self._closed or
                        f"rank {self.rank} lost its connection to the coordinator (rank 0): "
                        f"rank 0 exited, crashed or shut down. {windows.SHUT_DOWN_MESSAGE}")
            return False
        return True

    def _finish_shutdown(self) -> None:
        # The steady rounds this rank finished: a peer still in the last of them will finish it
        # (this rank's part of it is sent), so it must not fail that round's tensors.
        rounds = dict(self._rounds_left)
        rounds.update({sid: (st.epoch, st.round_no) for sid, st in list(self.steady.items())})
        self._close(windows.SHUT_DOWN_MESSAGE)
        self._close_peer_sockets()
        try:
            reason = self.exit_reason
            self.channel.send((Msg.SHUTDOWN, rounds) if reason is None else
                              (Msg.SHUTDOWN, rounds, reason))
        except OSError:
            pass
        self.channel.close()

    def _close_peer_sockets(self) -> None:
        """The steady state's outgoing connections and listener (idempotent)."""
        for ch in self._peer_out.values():
            ch.close()
        if self._listener is not None:
            try:
                self._listener.close()
            except OSError:
                pass

    def _report_failure(self, message: str) -> None:
        try:
            self.channel.send((Msg.FAILED, message))
        except OSError:
            pass
        self._close(message)

    def _close(self, reason: str) -> None:
        """Fail everything pending; later enqueues raise with the same reason."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
            reason = self._closed
            pending = list(self._inflight.values())
            for launched in self._in_transport.values():
                pending.extend(launched)
            self._in_transport.clear()
            self._idle.notify_all()
            self._inflight.clear()
            self._queue.clear()
            self._held = []
        for e in pending:
            RECORDER.finished(e.flight, reason)
            e.handle._fail(reason)
