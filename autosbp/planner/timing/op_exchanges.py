"""The one hook that prices communication inside an op: its exchanges' time and held bytes.

Lives here: `ExchangeCost` (a candidate's exchanges priced: the exposed time in forward and in
backward, and the bytes they hold until backward) and `exchange_cost` (the hook `timing.candidates`
calls for every compute candidate). Lives elsewhere: what an op exchanges (`rules.exchanges`,
declared by its rule: `rules.comm.Exchange`), the collective prices (`costmodel.prices`,
behind `timing.boxing_prices.Prices`), the runtime that runs them (`runtime.execute.op_comm`).

Model:
- each exchange costs `Prices.collective_time_s(kind, message_bytes, n, link)` with n the
  mesh dim's size and link its link class (a send/recv: `p2p_time_s`), once per micro-batch,
  in forward or backward as declared;
- an exchange the runtime waits for before computing (`overlaps` False: the all-gather of keys
  and values, the swaps of context parallelism) is exposed whole; one it runs beside the op's
  compute is hidden up to the profile's overlap efficiency a: exposed = t - a min(t, b c), with
  c the op's compute in that direction, b the exchange's `beside` share of it (a ring step:
  its step's compute) and the remaining overlapping exchanges sharing what is left of c;
- `held_bytes` stay alive from the op's forward to its backward (a gathered copy autograd
  saves): counted like the node's kept outputs, per micro-batch in flight, where the node is
  not recomputed (a recomputed node gathers again in backward: held while its run recomputes).
Invariants: a candidate without exchanges costs 0 and holds 0 (today's behaviour unchanged).
A candidate's repeated exchanges (a ring's steps) are priced once (the same arguments).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autosbp.capturing.graph import OpNode
from autosbp.planner.timing.boxing_prices import Prices
from autosbp.rules import Exchange, NdSignature, exchanges
from autosbp.sbp import Mesh

__all__ = ["ExchangeCost", "exchange_cost"]


@dataclass(frozen=True, slots=True)
class ExchangeCost:
    """A candidate's communication inside the op, per micro-batch on one device."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    held_bytes: float = 0.0


NO_EXCHANGE = ExchangeCost()


def exchange_cost(
    attrs: OpNode,
    sig: NdSignature,
    mesh: Mesh,
    prices: Prices,
    forward_compute_s: float,
    backward_compute_s: float,
) -> ExchangeCost:
    """The exchanges `attrs` runs inside itself under `sig` on `mesh`, priced (module header)."""
    declared = exchanges(attrs, sig, mesh.shape)
    if not declared:
        return NO_EXCHANGE
    forward = [e for e in declared if not e.backward]
    backward = [e for e in declared if e.backward]
    return ExchangeCost(
        forward_s=_exposed_s(forward, mesh, prices, forward_compute_s),
        backward_s=_exposed_s(backward, mesh, prices, backward_compute_s),
        held_bytes=sum(e.held_bytes for e in declared),
    )


def _exposed_s(declared: Sequence[Exchange], mesh: Mesh, prices: Prices, compute_s: float) -> float:
    exposed, hideable = 0.0, compute_s
    times: dict[tuple[str, float, int], float] = {}  # a ring's steps repeat one exchange
    for e in declared:
        key = (e.kind, e.message_bytes, e.mesh_dim)
        t = times.get(key)
        if t is None:
            t = times[key] = _time_s(e, mesh, prices)
        if e.overlaps:
            beside = min(t, hideable, e.beside * compute_s)  # the compute it runs beside
            hideable -= beside
            t -= prices.overlap_efficiency * beside
        exposed += t
    return exposed


def _time_s(e: Exchange, mesh: Mesh, prices: Prices) -> float:
    link = mesh.link_classes[e.mesh_dim]
    if e.kind == "send_recv":
        return prices.p2p_time_s(e.message_bytes, link)
    return prices.collective_time_s(e.kind, e.message_bytes, mesh.shape[e.mesh_dim], link)
