"""Which replica serves a leg: pure functions over the pools' current state, and `Tries`,
the replicas one leg tries in order, each picked by them as it is asked for."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from bidirkv.router.pool.backends import Backend, Pool


def least_outstanding(
    backends: Sequence[Backend], start: int = 0, exclude: Collection[Backend] = ()
) -> Backend | None:
    """Healthy replica with the fewest legs in flight; a draining one only when every
    healthy replica is draining (serving the turn beats refusing it: the only decode
    replica of a role can be the one leaving).

    Ties are broken by scanning from `start` (a rotating counter), so an idle cluster
    still spreads sequential requests instead of always picking the first replica.
    """
    best = _least(backends, start, exclude, draining=False)
    return best if best is not None else _least(backends, start, exclude, draining=True)


def _least(backends: Sequence[Backend], start: int, exclude: Collection[Backend],
           draining: bool) -> Backend | None:
    n = len(backends)
    best: Backend | None = None
    for i in range(n):
        b = backends[(start + i) % n]
        if not b.healthy or b.draining != draining or b in exclude:
            continue
        if best is None or b.outstanding < best.outstanding:
            best = b
            if b.outstanding == 0:
                break
    return best


def holder_of(
    decodes: Sequence[Backend], decode_url: str | None, remote_host: str | None
) -> Backend | None:
    """The decode replica holding a handle's blocks: by the URL the handle came from, else
    by its `remote_host` when exactly one replica has that host (ports in params are NIXL
    side-channel ports, not HTTP ports, so a host shared by replicas is ambiguous)."""
    if decode_url:
        for b in decodes:
            if b.url == decode_url:
                return b
    if remote_host:
        same = [b for b in decodes if b.host == remote_host]
        if len(same) == 1:
            return same[0]
    return None


# How many more legs in flight the holder may have than the least loaded replica and still
# get the turn. The holder is worth a little: its prefix cache still has the history, so
# D pulls less from P. It is not worth a queue: P reads the holder's blocks on its own leg
# whichever replica decodes, so any replica can decode the turn.
HOLDER_SLACK = 4


def pick_decode(decodes: Sequence[Backend], start: int = 0, exclude: Collection[Backend] = (),
                decode_url: str | None = None, remote_host: str | None = None,
                slack: int = HOLDER_SLACK) -> Backend | None:
    """The conversation's holder when it is usable and not much busier than the least
    loaded replica (`slack` legs), else the least loaded replica. A draining holder
    keeps the turn only when no replica that is not leaving can take it: elsewhere,
    prefill reads the holder's blocks and the conversation moves."""
    best = least_outstanding(decodes, start, exclude)
    holder = holder_of(decodes, decode_url, remote_host)
    if holder is not None and holder.healthy and holder not in exclude and (
            best is None or holder.outstanding <= best.outstanding + slack) and (
            not holder.draining or best is None or best.draining):
        return holder
    return best


class Tries:
    """The replicas of `pool` one leg tries, in order, each picked as it is asked for: from
    the pool as it is then (loads move, and a replica that failed is out of service),
    never one in `tried`; the conversation's holder (`holder_url`) when it is not much
    busier (`pick_decode`). `avoid`: a busy holder, which the first pick passes over
    when another replica can take the leg."""

    __slots__ = ("pool", "holder_url", "avoid", "tried")

    def __init__(self, pool: Pool, holder_url: str | None = None,
                 avoid: Backend | None = None) -> None:
        self.pool = pool
        self.holder_url = holder_url
        self.avoid = avoid
        self.tried: list[Backend] = []

    def next(self) -> Backend | None:
        pool, tried = self.pool, self.tried
        if self.avoid is not None:
            avoid, self.avoid = self.avoid, None
            b = least_outstanding(pool.backends, pool.next_start(), [*tried, avoid])
            if b is not None:
                return b
        return pick_decode(pool.backends, pool.next_start(), tried, self.holder_url)
