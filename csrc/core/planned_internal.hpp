// Internal to the plan-guided allocator's sources (planned*.cpp): the constants its rules
// are tuned by and the hashing helpers of detection. Not part of the library's API.
#pragma once

#include <cstddef>
#include <cstdint>

#include "allocator_api.hpp"
#include "util.hpp"

namespace pymemplan::planned_internal {

inline constexpr std::uint64_t kHashBase = 1099511628211ULL;  // odd: arithmetic mod 2^64 stays invertible
inline constexpr std::size_t kAlign = 512;
// A candidate period is planned only if at least this share of the bytes allocated during it
// have a lifetime known and within the period (the rest would bypass the plan).
inline constexpr double kMinCoverage = 0.5;
// Candidate periods examined per detection (newest occurrences of the window, plus the oldest
// reached within kMaxChain steps of its chain).
inline constexpr std::size_t kMaxCandidates = 64;
inline constexpr std::size_t kMaxChain = 256;
// Detection runs at most once per (its work / kDetectBudget) events.
inline constexpr std::size_t kDetectBudget = 32;
// Candidate periods whose coverage is within this of the best one's are tied (see detect()).
inline constexpr double kTieMargin = 0.02;
// Two candidates predict the same period if this share of their events (sampled) are equal:
// the rest are frees whose distance depends on the step before.
inline constexpr double kSameShare = 0.95;
// Validation: a plan is armed at its cut only after a pass (cut to cut, or from adoption to
// the cut) in which requests of less than arena / kArmShare bytes failed to match it; an armed
// plan lets its arena go once mismatched requests exceed arena / kDisarmShare bytes in a pass.
inline constexpr std::size_t kArmShare = 32;
// Smallest share of the highest live (requested) bytes a plan's bound must reach to be armed.
inline constexpr double kMinPlanShare = 0.2;
inline constexpr std::size_t kDisarmShare = 16;
// A plan just made arms for the rest of the pass it was found in (arm_mid_pass()) if no more
// than kMidPassWindows match windows and 1/kMidPassShare of that pass have gone by: as soon
// as detection could tell. Deeper in, blocks of the pass that the plan does not place count
// in what it is said to need (llama_6l, 509 events in: 1,129 MiB for a peak of 877).
inline constexpr std::size_t kMidPassWindows = 2;
inline constexpr std::size_t kMidPassShare = 4;
// A request that would carry a serving plan's cursor past planned slots holding more than
// kHeldJump times its own bytes is served there, but the cursor waits for the next request
// (match_plan()).
inline constexpr std::size_t kHeldJump = 16;
// An arming keeps mapped what the plans that served within the last kRecentPeriods of their
// periods took, and what the steps between their passes had live.
inline constexpr std::uint64_t kRecentPeriods = 16;

inline std::uint64_t mix(std::uint64_t x) {  // splitmix64 finalizer
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline std::uint64_t alloc_token(std::size_t rounded, StreamId stream) {
  return mix(mix(static_cast<std::uint64_t>(rounded)) ^ (stream * 0x2545f4914f6cdd1dULL));
}

inline std::uint64_t free_token(std::uint64_t distance) { return mix(distance ^ 0xf1ee5eedf1ee5eedULL); }

inline std::uint64_t pow_base(std::uint64_t e) {
  std::uint64_t r = 1, b = kHashBase;
  while (e != 0) {
    if (e & 1) r *= b;
    b *= b;
    e >>= 1;
  }
  return r;
}

}  // namespace pymemplan::planned_internal
