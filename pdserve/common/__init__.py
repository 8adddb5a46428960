"""The shared floor: small modules every layer may import (error types, sampling value
rules, block hashing, model-file resolution, the token-id check, the Redis key layout,
chat rendering). Nothing here imports torch, an engine, a server or a client library."""
