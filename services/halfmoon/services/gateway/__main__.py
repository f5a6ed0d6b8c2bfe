"""``python -m halfmoon.services.gateway``: the OpenAI-compatible HTTP front door."""

from halfmoon.services.gateway.service import GatewayService
from halfmoon.service import main

if __name__ == "__main__":
    main(GatewayService)
