"""KV cache: where a token's KV lives, from the device pool down to disk and other replicas.

The map, from the token up:

- **Pool** (one per model, `bind_kv_cache`; Llama family `[layers, 2, kv_heads, slots, width]`, MLA latents +
  indexer keys): `slots` token slots in blocks of `block_size`. Block 0 is the null block: never handed out,
  zeroed, read wherever a row has no block (padding, offloaded entries). A row is stored in the pool's KV format
  (`kv_format.py`: float, bfloat16 by default for a float32 model on CPU, or int8 / fp8 codes with the row's
  float16 scale packed after them, width head_dim + 2;
  the pool's dtype names its format), quantized at the write and dequantized by every reader, so block copies
  carry the scales; MLA latent pools are float only.
- **Block table** (`seq_kv.py` `SeqKV`, held by the engine's Sequence as `seq.kv`): entry `i` is the pool block
  holding positions `i * block_size ...`, or `OFFLOADED` when that KV left the pool. `slots.py`: the slot of
  a position (`slots_of`) and tables as tensors (`table_tensor`), the one formula every reader uses.
- **Allocator** (`blocks.py` `BlockManager`): reference counts, an LRU free list, prefix caching by chained block
  hashes (cache salt included); freed blocks keep their hash until reused, so later prompts still hit them.
- **Tiers** (`tiers.py`): when a cached prefix chunk (`kv_chunk_tokens`, aligned to the sequence start) is evicted
  from the pool it goes to host RAM, then disk (`chunk_store.py`); a prompt continuing past its device hit loads
  it back as cached blocks. Chunks are named by their last block hash and `kv_identity` (`kv_io.py`: the KV
  format included, so a chunk written in one format is never read in another).
- **Running offload** (`offload.py`): a running sequence longer than the pool keeps its first chunk and its tail
  resident; older chunks go to pinned host memory or an unlinked scratch file (keyed by `SeqKV.kv_id`, their
  table entries `OFFLOADED`), and attention reads them back layer by layer.
- **Sessions**: `session_store.py` `SessionStore` (a session's chunks and record in a `ChunkStore`: disk, or Redis
  `redis_store.py` shared by replicas; TTL and size cap) and `session_io.py` `SessionKV` (a finished turn's KV
  saved from the pool, the next turn's prefix restored into it, in background threads).
- **Block I/O** (`kv_io.py` `KVBlockIO`): batched gather / scatter of whole blocks for any pool layout, used by
  tiers, offload and sessions; its load listeners run after every scatter.
- **Side pools** indexed by the same blocks and slots (glmserve/sparse/): the block indexer's key bounds
  (`[blocks, 2, kv_heads, head_dim]` per layer, written with the KV; offloaded chunks carry theirs) and the
  learned indexer's index keys (`[layers, slots, d]`, bfloat16). KV loaded straight into the pool (tiers,
  sessions) refreshes both through `KVBlockIO` load listeners.

`stack.py` builds it all for an engine (`plan_pool`: the pool's size from a byte budget; `KVStack.build`: the
allocator, block I/O, tiers, offload and sessions around the pool the model allocated).
"""
