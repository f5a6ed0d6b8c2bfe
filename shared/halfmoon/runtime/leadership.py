"""One active instance of a role, the others hot standbys: a lease in a JetStream key-value bucket.

The bucket's entries expire ``ttl_s`` after their last write, so a lease its holder stops renewing
(the process died, stalled or lost NATS) is gone within ``ttl_s`` and the next ``try_acquire`` of a
standby wins it. Creating the key succeeds for one contender only; renewing needs the revision the
holder last wrote, so a holder that lost the lease cannot take it back by renewing. Instance ids
name one live process at a time, so a process restarted under its old id takes its lease back at once.
"""

from __future__ import annotations

import time

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

RENEWALS_PER_TTL = 3  # a holder renews this often per ttl, so one late renewal never loses the lease


class Leadership:
    """Contract: ``held`` is true only while this holder's last successful create or renew is younger
    than ``ttl_s`` minus one renewal period (the time a standby could need to see the lease expire),
    so two holders never both see ``held``; ``try_acquire`` and ``renew`` never raise on contention."""

    def __init__(self, js: JetStreamContext, bucket: str, name: str, holder: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.js, self.bucket, self.name, self.holder, self.ttl_s = js, bucket, name, holder, ttl_s
        self._kv: KeyValue | None = None
        self._revision = 0
        self._renewed_at: float | None = None

    @property
    def period_s(self) -> float:
        return self.ttl_s / RENEWALS_PER_TTL

    @property
    def held(self) -> bool:
        return self._renewed_at is not None and time.monotonic() - self._renewed_at < self.ttl_s - self.period_s

    async def _bucket(self) -> KeyValue:
        if self._kv is None:
            try:
                self._kv = await self.js.key_value(self.bucket)
            except BucketNotFoundError:
                self._kv = await self.js.create_key_value(KeyValueConfig(bucket=self.bucket, history=1, ttl=self.ttl_s))
        return self._kv

    async def try_acquire(self) -> bool:
        """Take the lease if nobody holds it; True when this holder has it now."""
        kv = await self._bucket()
        started = time.monotonic()
        try:
            self._revision = await kv.create(self.name, self.holder.encode())
        except (KeyWrongLastSequenceError, NotFoundError):  # held (or expiring as we asked: next time)
            return self.held or await self._reclaim(kv, started)
        self._renewed_at = started
        return True

    async def _reclaim(self, kv: KeyValue, started: float) -> bool:
        """A lease under this holder's own name that this object does not hold: the holder restarted
        under the same instance id (a supervisor does that only once the old process is gone)."""
        try:
            entry = await kv.get(self.name)
            if entry.value != self.holder.encode() or entry.revision is None:
                return False
            self._revision = await kv.update(self.name, self.holder.encode(), last=entry.revision)
        except (KeyWrongLastSequenceError, NotFoundError):
            return False
        self._renewed_at = started
        return True

    async def renew(self) -> bool:
        """Extend a held lease; False (and no longer held) when it expired or someone else has it."""
        if self._renewed_at is None:
            return False
        kv = await self._bucket()
        started = time.monotonic()
        try:
            self._revision = await kv.update(self.name, self.holder.encode(), last=self._revision)
        except (KeyWrongLastSequenceError, NotFoundError):
            self._renewed_at = None
            return False
        self._renewed_at = started
        return True

    async def release(self) -> None:
        """Give the lease up now (a clean stop), so a standby need not wait for it to expire."""
        if self._renewed_at is None or self._kv is None:
            return
        self._renewed_at = None
        try:
            entry = await self._kv.get(self.name)
            if entry.value == self.holder.encode() and entry.revision == self._revision:
                await self._kv.delete(self.name, last=self._revision)
        except (KeyWrongLastSequenceError, NotFoundError):
            pass
