"""``python -m services.gateway``: the OpenAI-compatible HTTP front door."""

from services.gateway.service import GatewayService
from shared.service import main

if __name__ == "__main__":
    main(GatewayService)
