"""Looking inside a fault drill: the pool's block count."""

from __future__ import annotations

import asyncio

from halfmoon.deploy.drills import operator_nats
from halfmoon.deploy.local import LocalCluster
from halfmoon.protocol import codecs
from halfmoon.protocol.base import Codec
from halfmoon.protocol.pool import StatsRequest
from halfmoon.protocol.subjects import Subjects


def pool_block_count(cluster: LocalCluster) -> int:
    async def ask() -> int:
        nc = await operator_nats(cluster)
        try:
            msg = await nc.request(Subjects(cluster.namespace).cache("stats"), Codec.encode(StatsRequest()), 5)
            return codecs.CACHE_STATS.decode(msg.data).blocks
        finally:
            await nc.close()

    return asyncio.run(ask())
