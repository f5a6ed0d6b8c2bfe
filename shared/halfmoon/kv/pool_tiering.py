"""Tiering decisions of the pool index: watermark relief by demotion (DRAM -> NVMe -> S3, drop
when no lower tier has room), promotion of blocks hit in a lower tier (into DRAM room below the
low watermark), and extra DRAM replicas for hot blocks. Orders are two-phase: the destination
is reserved when the order is issued, and ``finish`` applies the node's outcome, so a failed
copy never loses the source."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from halfmoon.kv.pool_nodes import NodeLedger
from halfmoon.kv.pool_state import PoolState
from halfmoon.kv.pool_types import Order, OrderKind, Replica, Tier

Placer = Callable[[int, int, set[str], Sequence[Tier]], list[Replica]]


class Tiering:
    def __init__(self, state: PoolState, place: Placer) -> None:
        self.state = state
        self._place = place
        self.orders: dict[int, Order] = {}

    def plan(self, now: float) -> list[Order]:
        orders = self._promotions() + self._hot_replicas(now)
        for ledger in list(self.state.nodes.values()):
            for tier in (t for t in Tier if t in ledger.spec.capacity):
                draining = sum(
                    o.src.size for o in self.orders.values()
                    if o.kind is OrderKind.DEMOTE and o.src.node == ledger.spec.node_id and o.src.tier == tier
                )  # fmt: skip
                need = ledger.excess(tier, self.state.config.watermarks) - draining
                if need > 0:
                    orders += self._relieve(ledger, tier, need, now)
        return orders

    def _promotions(self) -> list[Order]:
        orders, st = [], self.state
        for key in st.want_promote:
            block = st.blocks.get(key)
            if block is None or block.busy or block.in_dram():
                continue
            src = min(block.replicas, key=lambda r: r.tier)
            ledger = st.nodes[src.node]
            # NOTE: promotions only use room below the low watermark, so they never cause demotions.
            if ledger.headroom(Tier.DRAM, st.config.watermarks) >= src.size and (
                dst := ledger.reserve(Tier.DRAM, src.size)
            ):
                orders.append(self._issue(OrderKind.PROMOTE, key, src, dst))
        st.want_promote.clear()
        return orders

    def _hot_replicas(self, now: float) -> list[Order]:
        orders, st, cfg = [], self.state, self.state.config
        for key in st.want_hot:
            block = st.blocks.get(key)
            if block is None or block.busy or block.read_rate(now, cfg.hot_window_s) <= cfg.hot_reads_per_s:
                continue
            in_dram = block.in_dram()
            if len(in_dram) >= cfg.max_hot_replicas:
                continue
            src = in_dram[0] if in_dram else min(block.replicas, key=lambda r: r.tier)
            placed = self._place(src.size, 1, {r.node for r in block.replicas}, (Tier.DRAM,))
            if placed:
                orders.append(self._issue(OrderKind.REPLICATE, key, src, placed[0]))
        st.want_hot.clear()
        return orders

    def _relieve(self, ledger: NodeLedger, tier: Tier, need: int, now: float) -> list[Order]:
        orders: list[Order] = []
        for key in ledger.policies[tier].victims(ledger.blocks[tier], self.state.protected):
            if need <= 0:
                break
            block = self.state.blocks[key]
            src = next(r for r in block.replicas if r.node == ledger.spec.node_id and r.tier == tier)
            need -= src.size
            lower = ledger.lower_tier(tier, src.size)
            dst = ledger.reserve(lower, src.size) if lower is not None else None
            if dst is not None:
                orders.append(self._issue(OrderKind.DEMOTE, key, src, dst))
            else:
                orders.append(self.state.drop_replica(key, block, src))
        return orders

    def _issue(self, kind: OrderKind, key: bytes, src: Replica, dst: Replica) -> Order:
        order = Order(self.state.new_id(), kind, key, src, dst)
        self.orders[order.order_id] = order
        self.state.blocks[key].busy += 1
        return order

    def finish(self, order_id: int, ok: bool, now: float) -> list[Order]:
        """Apply a node's outcome; returns FREE orders for copies nobody needs any more."""
        order = self.orders.pop(order_id, None)
        if order is None or order.dst is None:
            return []
        st = self.state
        block, dst_ledger = st.blocks.get(order.key), st.nodes.get(order.dst.node)
        if block is not None:
            block.busy -= 1
        if not ok or block is None or dst_ledger is None:
            if dst_ledger is not None:
                dst_ledger.release(order.dst)
            return [Order(st.new_id(), OrderKind.FREE, order.key, order.dst, None)] if ok and dst_ledger else []
        st.add_replica(order.key, block, order.dst, now)
        if order.kind is OrderKind.DEMOTE and order.src in block.replicas:
            st.drop_replica(order.key, block, order.src)
        return []

    def cancel_node(self, node_id: str, now: float) -> None:
        """Fail every order that reads from or writes to a node that went away."""
        for oid, order in list(self.orders.items()):
            if node_id in (order.src.node, order.dst.node if order.dst else None):
                self.finish(oid, ok=False, now=now)
