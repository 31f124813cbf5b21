"""flatwire-client: flatwire's gRPC and HTTP APIs with every token's top-k logprobs as numpy arrays.

Depends on flatwire's wire layer (flatwire-wire: grpcio, protobuf and numpy) only. See README.md.
"""

from flatwire_client.grpc_client import AsyncFlatwireClient, AsyncGenerationStream, FlatwireClient, GenerationStream
from flatwire_client.http_client import AsyncHttpClient, HttpClient, HttpError, HttpGenerationStream
from flatwire_client.requests import Options
from flatwire_client.results import Generation, Logprobs, VersionSpan

__all__ = ["AsyncFlatwireClient", "AsyncGenerationStream", "AsyncHttpClient", "FlatwireClient", "Generation",
           "GenerationStream", "HttpClient", "HttpError", "HttpGenerationStream", "Logprobs", "Options", "VersionSpan"]
