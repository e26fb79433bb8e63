// The caching allocator: page sharing. Rules marked "torch:" model
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
// Page sharing

std::vector<CachingAllocator::Ranges> CachingAllocator::page_uses(const Segment* seg) const {
  // One walk over the segment's blocks (a list by address). Free space a plan has claimed
  // is as good as used: its blocks are on their way.
  const std::size_t page = device_->granularity();
  std::vector<Ranges> used(seg->pages.size());
  for (const Block* b = seg->head; b != nullptr; b = b->next) {
    if (b->listed && !b->claimed) continue;
    const std::size_t lo = b->addr - seg->addr, hi = lo + b->size;
    for (std::size_t i = lo / page; i * page < hi; ++i) {
      const std::size_t a = std::max(lo, i * page) - i * page;
      const std::size_t z = std::min(hi, (i + 1) * page) - i * page;
      Ranges& r = used[i];
      if (!r.empty() && r.back().second == a) {
        r.back().second = z;
      } else {
        r.emplace_back(a, z);
      }
    }
  }
  return used;
}

namespace {
bool disjoint(const std::vector<std::pair<std::size_t, std::size_t>>& a,
              const std::vector<std::pair<std::size_t, std::size_t>>& b) {
  std::size_t i = 0, j = 0;
  while (i < a.size() && j < b.size()) {
    if (a[i].second <= b[j].first) {
      ++i;
    } else if (b[j].second <= a[i].first) {
      ++j;
    } else {
      return false;
    }
  }
  return true;
}
}  // namespace

std::vector<SharePair> CachingAllocator::share_candidates(
    const std::vector<std::uintptr_t>& leave_out) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return share_candidates_locked(leave_out);
}

std::vector<SharePair> CachingAllocator::share_candidates_locked(
    const std::vector<std::uintptr_t>& leave_out) const {
  std::vector<SharePair> out;
  if (!config_.vmm || !device_->supports_page_sharing()) return out;
  const std::size_t page = device_->granularity();
  struct Candidate {
    std::uintptr_t addr;
    Ranges used;
    std::size_t bytes;
  };
  // Pages held by blocks in use (or waiting on events) but not filled by them, not shared
  // already. Space claimed by a plan counts as used.
  std::vector<Candidate> c;
  std::vector<std::uintptr_t> excluded;  // pages touched by the blocks left out
  for (std::uintptr_t a : leave_out) {
    auto it = allocated_.find(a);
    if (it == allocated_.end() || !it->second->segment->vmm) continue;
    const Block* b = it->second;
    for (std::uintptr_t p = b->addr / page * page; p < b->addr + b->size; p += page) excluded.push_back(p);
  }
  std::sort(excluded.begin(), excluded.end());
  for (const auto& [addr, seg] : segments_) {
    if (!seg->vmm || seg->arena || seg->mapped == seg->unused_mapped) continue;
    std::vector<Ranges> uses = page_uses(seg);
    for (std::size_t i = 0; i < seg->pages.size(); ++i) {
      if (seg->pages[i] == 0 || seg->users[i] == 0) continue;
      if (shares_.count(seg->addr + i * page) != 0) continue;
      if (std::binary_search(excluded.begin(), excluded.end(), seg->addr + i * page)) continue;
      std::size_t bytes = 0;
      for (const auto& [lo, hi] : uses[i]) bytes += hi - lo;
      if (bytes < page) c.push_back({seg->addr + i * page, std::move(uses[i]), bytes});
    }
  }
  // First fit by decreasing use: each page pairs with the first later one whose live bytes
  // lie at other offsets; the fuller page keeps its physical page, so the least is copied.
  // Quadratic in the partly used pages, which are few (blocks in use mostly fill theirs);
  // bounded all the same.
  std::stable_sort(c.begin(), c.end(),
                   [](const Candidate& a, const Candidate& b) { return a.bytes > b.bytes; });
  constexpr std::size_t kMaxCandidates = 4096;
  if (c.size() > kMaxCandidates) c.resize(kMaxCandidates);
  std::vector<bool> taken(c.size(), false);
  for (std::size_t a = 0; a < c.size(); ++a) {
    if (taken[a]) continue;
    for (std::size_t b = a + 1; b < c.size(); ++b) {
      if (taken[b] || c[a].bytes + c[b].bytes > page || !disjoint(c[a].used, c[b].used)) continue;
      taken[a] = taken[b] = true;
      out.push_back({c[a].addr, c[b].addr, c[b].used});
      break;
    }
  }
  return out;
}

std::vector<std::pair<std::uintptr_t, std::size_t>> CachingAllocator::holes_after_sharing(
    const std::vector<std::pair<std::uintptr_t, std::size_t>>& holes,
    const std::vector<SharePair>& pairs) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::size_t page = device_->granularity();
  // What sharing takes from free space: the whole alias page (its free offsets are the kept
  // page's), and the alias's live offsets in the kept page.
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> taken;
  for (const SharePair& sp : pairs) {
    taken.emplace_back(sp.alias, sp.alias + page);
    for (const auto& [lo, hi] : sp.alias_used) taken.emplace_back(sp.keep + lo, sp.keep + hi);
  }
  std::sort(taken.begin(), taken.end());
  std::vector<std::pair<std::uintptr_t, std::size_t>> out;
  for (const auto& [addr, n] : holes) {
    std::uintptr_t lo = addr;
    const std::uintptr_t hi = addr + n;
    auto it = std::upper_bound(taken.begin(), taken.end(), std::make_pair(lo, std::uintptr_t{0}));
    if (it != taken.begin()) --it;
    for (; it != taken.end() && it->first < hi && lo < hi; ++it) {
      if (it->second <= lo) continue;
      if (it->first > lo) out.emplace_back(lo, it->first - lo);
      lo = std::max(lo, it->second);
    }
    if (lo < hi) out.emplace_back(lo, hi - lo);
  }
  return out;
}

bool CachingAllocator::stop_automatic_page_sharing() {
  std::lock_guard<std::mutex> lock(mutex_);
  const bool was = config_.vmm && config_.share_pages && device_->supports_page_sharing();
  config_.share_pages = false;
  return was;
}

std::size_t CachingAllocator::share_pages() {
  const std::vector<SharePair> pairs = share_candidates();
  return pairs.empty() ? 0 : share_pages(pairs);
}

std::size_t CachingAllocator::share_pages(const std::vector<SharePair>& pairs) {
  std::lock_guard<std::mutex> lock(mutex_);
  return share_pages_locked(pairs);
}

std::size_t CachingAllocator::share_pages_locked(const std::vector<SharePair>& pairs) {
  if (!config_.vmm || !device_->supports_page_sharing() || pairs.empty()) return 0;
  const std::size_t page = device_->granularity();
  // Queued work may still write the blocks about to be copied.
  device_->synchronize_device();
  ++stats_.num_sync_all_streams;
  synchronize_and_free_events();
  std::size_t given_back = 0;
  // Pages in use per segment, walked once each (a pair changes only its own two pages).
  std::unordered_map<const Segment*, std::vector<Ranges>> uses;
  auto uses_of = [&](const Segment* seg) -> std::vector<Ranges>& {
    auto it = uses.find(seg);
    if (it == uses.end()) it = uses.emplace(seg, page_uses(seg)).first;
    return it->second;
  };
  for (const SharePair& sp : pairs) {
    // Checked again: the pairs may have been found before blocks were freed (only freeing
    // can have happened since, under the caller's lock, and that keeps a pair disjoint),
    // and a bad pair from a caller must not corrupt memory.
    Segment* keep = segment_of(sp.keep);
    Segment* alias = segment_of(sp.alias);
    if (keep == nullptr || alias == nullptr || sp.keep % page != 0 || sp.alias % page != 0 ||
        sp.keep == sp.alias || shares_.count(sp.keep) != 0 || shares_.count(sp.alias) != 0) {
      continue;
    }
    const std::size_t ki = (sp.keep - keep->addr) / page, ai = (sp.alias - alias->addr) / page;
    // A page that nothing uses any more is better given back as it is.
    if (keep->pages[ki] == 0 || alias->pages[ai] == 0 || keep->users[ki] == 0 ||
        alias->users[ai] == 0) {
      continue;
    }
    const Ranges keep_used = uses_of(keep)[ki], alias_used = uses_of(alias)[ai];
    if (alias_used.empty() || !disjoint(keep_used, alias_used)) continue;
    if (!share_pair(keep, ki, alias, ai, alias_used)) break;
    given_back += page;
  }
  return given_back;
}

Segment* CachingAllocator::segment_of(std::uintptr_t addr) const {
  // A virtual segment of the pool (arenas excepted) holding addr, or nullptr.
  auto it = segments_.upper_bound(addr);
  if (it == segments_.begin()) return nullptr;
  Segment* seg = std::prev(it)->second;
  if (!seg->vmm || seg->arena || addr >= seg->addr + seg->size) return nullptr;
  return seg;
}

bool CachingAllocator::share_pair(Segment* keep, std::size_t ki, Segment* alias, std::size_t ai,
                                  const Ranges& alias_used) {
  // The alias page's live bytes go to the same offsets of the kept page (free there), then
  // the alias address maps the kept page and its own page goes back. A driver error leaves
  // the alias page mapped as it was and stops sharing.
  const std::size_t page = device_->granularity();
  const std::uintptr_t kaddr = keep->addr + ki * page, aaddr = alias->addr + ai * page;
  const PageHandle kept = keep->pages[ki], own = alias->pages[ai];
  try {
    for (const auto& [lo, hi] : alias_used) {
      device_->copy(reinterpret_cast<void*>(kaddr + lo), reinterpret_cast<const void*>(aaddr + lo),
                    hi - lo);
    }
    device_->unmap_page(reinterpret_cast<void*>(aaddr));
  } catch (const DeviceError&) {
    return false;
  }
  try {
    device_->map_page(reinterpret_cast<void*>(aaddr), kept);
  } catch (const DeviceError&) {
    try {
      device_->map_page(reinterpret_cast<void*>(aaddr), own);  // its bytes are still there
    } catch (const DeviceError&) {
      alias->pages[ai] = 0;  // lost: the address is unmapped, the page released
      --alias->mapped;
      device_->release_page(own);
      reserved_ -= static_cast<std::int64_t>(page);
      update_stat(&Stats::reserved_bytes, false, -static_cast<std::int64_t>(page));
      ++stats_.num_device_free;
      throw;
    }
    return false;
  }
  device_->release_page(own);
  alias->pages[ai] = kept;
  reserved_ -= static_cast<std::int64_t>(page);
  update_stat(&Stats::reserved_bytes, alias->small, -static_cast<std::int64_t>(page));
  ++stats_.num_device_free;
  auto* s = new Share{{keep, alias}, {ki, ai}, {}};
  // Each side's guards: the offsets the other side's blocks hold. The alias side owns only
  // its live ranges; the rest of the page (its free bytes included) stays with the kept side.
  auto guard_complement = [&](Segment* seg, std::size_t i, const Ranges& own_used,
                              std::vector<Block*>& out) {
    const std::uintptr_t base = seg->addr + i * page;
    std::size_t at = 0;
    for (const auto& [lo, hi] : own_used) {
      if (lo > at) out.push_back(make_guard(seg, base + at, base + lo));
      at = hi;
    }
    if (at < page) out.push_back(make_guard(seg, base + at, base + page));
  };
  guard_complement(alias, ai, alias_used, s->guards[1]);
  for (const auto& [lo, hi] : alias_used) s->guards[0].push_back(make_guard(keep, kaddr + lo, kaddr + hi));
  shares_[kaddr] = s;
  shares_[aaddr] = s;
  ++keep->shared_pages;
  ++alias->shared_pages;
  return true;
}

Block* CachingAllocator::cut_run(Block* b, std::uintptr_t lo, std::uintptr_t hi) {
  // Cut the run at lo and hi (the outer parts keep their owners) and merge what is between.
  erase_free(b);
  if (b->addr < lo) {
    Block* mid = split(b, lo);
    insert_free(b);
    b = mid;
  }
  while (b->addr + b->size < hi) {
    Block* next = b->next;
    erase_free(next);
    if (next->addr + next->size > hi) insert_free(split(next, hi));
    b = merge(b, next);
  }
  if (b->addr + b->size > hi) insert_free(split(b, hi));
  return b;
}

Block* CachingAllocator::make_guard(Segment* seg, std::uintptr_t lo, std::uintptr_t hi) {
  // [lo, hi) is free, inside one page: a run of listed blocks (of one owner, coalesced into
  // one; of several, merged here: the guard is nobody's).
  Block* b = seg->head;
  while (b->addr + b->size <= lo) b = b->next;
  Block* g = cut_run(b, lo, hi);
  g->guard = true;
  g->allocated = true;
  g->stream = kAnyStream;
  count_use(g, +1);
  return g;
}

void CachingAllocator::drop_guard(Block* g) {
  count_use(g, -1);
  g->guard = false;
  g->allocated = false;
  g->stream = kAnyStream;  // its address's owners were synchronized (end_share)
  insert_free(coalesce(g));
}

void CachingAllocator::end_idle_shares(Segment* seg, std::size_t first, std::size_t last) {
  const std::size_t page = device_->granularity();
  for (std::size_t i = first; i <= last; ++i) {
    auto it = shares_.find(seg->addr + i * page);
    if (it == shares_.end()) continue;
    Share* s = it->second;
    const int side = s->seg[0] == seg && s->index[0] == i ? 0 : 1;
    if (seg->users[i] == s->guards[side].size()) end_share(s, side);
  }
}

void CachingAllocator::end_share(Share* s, int side) {
  // `side` has no block in use but its guards: its address is unmapped, and the page is the
  // other side's alone. Free blocks there may still be touched by their owners' queued work.
  const std::size_t page = device_->granularity();
  Segment* seg = s->seg[side];
  const std::size_t i = s->index[side];
  const std::uintptr_t plo = seg->addr + i * page;
  std::vector<StreamId> owners;
  for (const Block* b = seg->head; b != nullptr && b->addr < plo + page; b = b->next) {
    if (b->addr + b->size > plo && b->listed && b->stream != kAnyStream &&
        std::find(owners.begin(), owners.end(), b->stream) == owners.end()) {
      owners.push_back(b->stream);
    }
  }
  for (StreamId st : owners) synchronize_stream(st);
  device_->unmap_page(reinterpret_cast<void*>(plo));
  seg->pages[i] = 0;
  --seg->mapped;
  shares_.erase(plo);
  shares_.erase(s->seg[1 - side]->addr + s->index[1 - side] * page);
  --s->seg[0]->shared_pages;
  --s->seg[1]->shared_pages;
  for (Block* g : s->guards[side]) drop_guard(g);
  for (Block* g : s->guards[1 - side]) drop_guard(g);
  delete s;
}

}  // namespace pymemplan
