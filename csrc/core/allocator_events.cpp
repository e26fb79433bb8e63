// The caching allocator: events and streams. Rules marked "torch:" model
// c10/cuda/CUDACachingAllocator.cpp; rules marked "ours:" are where pymemplan departs from it.
#include "allocator.hpp"

#include <algorithm>
#include <limits>
#include <numeric>

#include "allocator_internal.hpp"
#include "errors.hpp"

namespace pymemplan {

using namespace allocator_internal;

// ---------------------------------------------------------------------------------------------
// Events and streams

void CachingAllocator::process_events() {
  poll_epochs();
  // Completed events release their blocks; incomplete ones stay queued.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (!device_->query_event(it->event)) {
      ++it;
      continue;
    }
    PendingEvent done = *it;
    it = pending_.erase(it);
    complete_event(done);
    // complete_event may not touch pending_, so `it` stays valid.
  }
}

void CachingAllocator::synchronize_and_free_events() {
  if (!pending_.empty()) {
    ++stats_.num_sync_all_streams;
    std::deque<PendingEvent> all;
    all.swap(pending_);
    for (auto& p : all) {
      device_->synchronize_event(p.event);
      complete_event(p);
    }
  }
  synchronize_epochs();  // last: the blocks freed just now may have started one
}

void CachingAllocator::complete_event(const PendingEvent& p) {
  return_event(p.event);
  if (p.block != nullptr) {
    if (--p.block->pending_events == 0) free_block(p.block);
    return;
  }
  draining_.erase(std::remove(draining_.begin(), draining_.end(), p.drained_stream),
                  draining_.end());
  share_blocks_of(p.drained_stream, p.drain_seq);
}

void CachingAllocator::drain_other_streams(Pool& pool, StreamId stream) {
  // Ask every other stream holding free blocks in this pool to mark its queue; once the
  // mark is reached, the blocks it freed before are safe for any stream.
  bool recorded = false;
  Block probe;
  probe.size = 0;
  probe.addr = 0;
  for (auto it = pool.free.begin(); it != pool.free.end();) {
    const StreamId owner = (*it)->stream;
    if (owner == kAnyStream) break;  // kAnyStream sorts last
    if (owner != stream &&
        std::find(draining_.begin(), draining_.end(), owner) == draining_.end()) {
      EventHandle e = get_event();
      device_->record_event(e, owner);
      pending_.push_back({e, nullptr, owner, free_seq_});
      draining_.push_back(owner);
      recorded = true;
    }
    probe.stream = owner + 1;  // jump to the next owner
    it = pool.free.lower_bound(&probe);
  }
  if (recorded) process_events();
}

void CachingAllocator::share_blocks_of(StreamId owner, std::uint64_t up_to_seq) {
  for (Pool* pool : {&small_, &large_}) {
    Block probe;
    probe.stream = owner;
    probe.size = 0;
    probe.addr = 0;
    std::vector<Block*> blocks;
    for (auto it = pool->free.lower_bound(&probe);
         it != pool->free.end() && (*it)->stream == owner; ++it) {
      if ((*it)->free_seq <= up_to_seq) blocks.push_back(*it);
    }
    for (Block* b : blocks) {
      erase_free(b);
      b->stream = kAnyStream;
    }
    for (Block* b : blocks) {
      if (b->segment == nullptr) continue;  // absorbed by a neighbour shared in this pass
      b = coalesce(b);
      // A free neighbour still owned by one stream takes it in (its owner may use both): the
      // main stream's free space closes over a side stream's freed buffer even while the side
      // stream asks for nothing, at the price of that stream draining again to reuse it.
      Block* owned = nullptr;
      for (Block* n : {b->prev, b->next}) {
        if (n != nullptr && n->listed && n->stream != kAnyStream && n->claimed == b->claimed &&
            n->unmapped == b->unmapped) {
          owned = n;
          break;
        }
      }
      insert_free(b);
      if (owned != nullptr) {
        erase_free(owned);
        insert_free(coalesce(owned));
      }
    }
  }
  if (arena_free_.empty()) return;
  std::vector<Block*> blocks;
  for (Block* b : arena_free_) {
    if (b->stream == owner && b->free_seq <= up_to_seq) blocks.push_back(b);
  }
  for (Block* b : blocks) {
    erase_free(b);
    b->stream = kAnyStream;
  }
  for (Block* b : blocks) {
    if (b->segment == nullptr) continue;
    insert_free(coalesce(b));
  }
}

void CachingAllocator::start_drain(StreamId owner) {
  // Once an event recorded on `owner` now has completed, the blocks it freed so far are safe
  // for every stream (share_blocks_of).
  if (std::find(draining_.begin(), draining_.end(), owner) != draining_.end()) return;
  EventHandle e = get_event();
  device_->record_event(e, owner);
  pending_.push_back({e, nullptr, owner, free_seq_});
  draining_.push_back(owner);
}

EventHandle CachingAllocator::get_event() {
  if (event_pool_.empty()) return device_->create_event();
  EventHandle e = event_pool_.back();
  event_pool_.pop_back();
  return e;
}

void CachingAllocator::return_event(EventHandle e) { event_pool_.push_back(e); }

}  // namespace pymemplan
