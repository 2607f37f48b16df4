/* The C half of fiber.py: what wasmtime calls when a guest makes a blocking host call, the
 * poll that runs a guest on, and the epoch ticker's loop. Python reaches it through ctypes
 * (fiber.py loads it, built by native_build.py with zig's clang); it calls nothing of Python's,
 * so a guest's blocking call costs no callback into the interpreter and runs nothing on the
 * guest's cold fiber stack.
 *
 * The callback only records the call (which function, its arguments, where its results and
 * trap go) in the polled fiber's slot and hands wasmtime a continuation that reads the slot's
 * `answered` byte. `sym_fiber_poll` returns 2 when the guest made such a call; fiber.py then
 * runs the call's handler on its own stack, writes the results, raises `answered`, and the
 * next poll resumes the guest. (Measured, 1024 guests each making one blocking call a round:
 * 2.0 us per guest-round, against 6.4-8.0 with the call answered through a ctypes callback.)
 * A poll also prefetches what the caller's next poll will touch (prefetch_slot).
 *
 * Built with -nostdlib: it needs no C library, so zig compiles it in a tenth of a second
 * without building one first. wasmtime's functions arrive as pointers (`sym_fiber_init`). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SYM_FIBER_MAX_ARGS 16
#define SYM_FIBER_HOST_OBJECTS 8

typedef struct { /* wasmtime_val_t: a kind byte, then the value at offset 8 */
    uint8_t kind;
    uint8_t padding[7];
    uint8_t of[24];
} sym_val;

typedef struct { /* wasmtime_async_continuation_t */
    bool (*callback)(void *env);
    void *env;
    void (*finalizer)(void *env);
} sym_continuation;

/* One per fiber, owned by fiber.py's Fiber; its word indices (_FUTURE ... _ANSWERED) and
   _ARGS_OFFSET mirror this layout, checked at import through the two functions below. */
typedef struct {
    void *future;          /* the call's wasmtime_call_future_t */
    void *context;         /* its store's context, for a fresh time slice */
    uint64_t called;       /* 1 once the guest made a blocking call in this poll */
    uint64_t function;     /* the called host function's key (its env) */
    void *caller;          /* the wasmtime_caller_t, alive while the guest waits in the call */
    void *results;         /* where the call's results go (wasmtime_val_t[]) */
    void *trap_ret;        /* where a trap goes (wasm_trap_t **) */
    uint64_t nargs;
    uint8_t answered[8];   /* byte 0: the continuation's answer, raised once results are written */
    sym_val args[SYM_FIBER_MAX_ARGS];
    const char *stack;     /* where the guest's fiber stack was at its last blocking call (prefetch) */
    /* Host objects that handling its calls touches (fiber.py's `Fiber.prefetch_with`): their
       addresses and sizes, for prefetch_slot; unused entries are null. */
    const char *host_objects[SYM_FIBER_HOST_OBJECTS];
    uint64_t host_object_bytes[SYM_FIBER_HOST_OBJECTS];
} sym_fiber_slot;

typedef bool (*future_poll_fn)(void *future);
typedef void (*set_deadline_fn)(void *context, uint64_t ticks);
typedef void *(*trap_new_fn)(const char *message, size_t length);

static future_poll_fn future_poll;
static set_deadline_fn set_epoch_deadline;
static trap_new_fn trap_new;
static _Thread_local sym_fiber_slot *polled; /* the slot of the fiber this thread polls */
static uint8_t always_answered[8] = {1};

static const char NOT_POLLED[] = "a blocking host function was called outside Fiber.poll";

void sym_fiber_init(void *poll, void *set_deadline, void *new_trap) {
    future_poll = (future_poll_fn)poll;
    set_epoch_deadline = (set_deadline_fn)set_deadline;
    trap_new = (trap_new_fn)new_trap;
}

unsigned sym_fiber_slot_size(void) { return sizeof(sym_fiber_slot); }
unsigned sym_fiber_args_offset(void) { return offsetof(sym_fiber_slot, args); }
unsigned sym_fiber_host_objects_offset(void) { return offsetof(sym_fiber_slot, host_objects); }
unsigned sym_fiber_host_objects_max(void) { return SYM_FIBER_HOST_OBJECTS; }
unsigned sym_fiber_max_args(void) { return SYM_FIBER_MAX_ARGS; }

static bool read_answered(void *env) { return *(volatile uint8_t *)env != 0; }

/* wasmtime_func_async_callback_t of every blocking host function (env: the function's key). */
void sym_fiber_blocking_call(void *env, void *caller, const sym_val *args, size_t nargs, sym_val *results,
                             size_t nresults, void **trap_ret, sym_continuation *continuation) {
    (void)nresults;
    sym_fiber_slot *slot = polled;
    continuation->callback = read_answered;
    continuation->finalizer = 0;
    if (slot == 0 || nargs > SYM_FIBER_MAX_ARGS) { /* fiber.py defines no function with more */
        *trap_ret = trap_new(NOT_POLLED, sizeof(NOT_POLLED) - 1);
        continuation->env = always_answered;
        return;
    }
    for (size_t i = 0; i < nargs; i++)
        slot->args[i] = args[i];
    slot->nargs = nargs;
    slot->function = (uint64_t)(uintptr_t)env;
    slot->caller = caller;
    slot->results = results;
    slot->trap_ret = trap_ret;
    slot->stack = (const char *)__builtin_frame_address(0);
    slot->answered[0] = 0;
    slot->called = 1;
    continuation->env = slot->answered;
}

/* Ask the cache for what polling `slot`'s guest will touch first: the slot, the top of the
 * fiber's stack where the guest waits in its call, the store, the call's future and the
 * wasmtime state of the call it waits in, and the host objects registered with it. With a
 * thousand guests a round, each guest's is cold by its next poll (measured: a poll took 2.6 us
 * at 1024 guests against 1.0 at 16, and 1.85 with this run during the poll before). Any of
 * these addresses may be stale (a call since answered, a fiber that has finished, an object
 * freed): a prefetch never faults and changes nothing but the cache. */
#define PREFETCH_STACK_BELOW 512   /* the frames the guest's resumption returns through lie above */
#define PREFETCH_STACK_ABOVE 2048  /* measured: no better at 4 KB, worse at 16 */
static void prefetch(const void *address, unsigned bytes) {
    for (unsigned offset = 0; offset < bytes; offset += 64)
        __builtin_prefetch((const char *)address + offset, 0, 2);
}

static void prefetch_slot(const sym_fiber_slot *slot) {
    prefetch(slot, offsetof(sym_fiber_slot, args));
    if (slot->stack != 0)
        prefetch(slot->stack - PREFETCH_STACK_BELOW, PREFETCH_STACK_BELOW + PREFETCH_STACK_ABOVE);
    prefetch(slot->context, 256);
    prefetch(slot->future, 256);
    prefetch(slot->caller, 64);
    prefetch(slot->results, 64);
    prefetch(slot->trap_ret, 64);
    for (unsigned i = 0; i < SYM_FIBER_HOST_OBJECTS && slot->host_objects[i] != 0; i++)
        prefetch(slot->host_objects[i], (unsigned)slot->host_object_bytes[i]);
}

/* Run the fiber's guest on: 1 once its call finished, 2 if it made a blocking call (recorded
 * in the slot), 0 if it waits or yielded. A nonzero `time_slice_ticks` gives it a fresh slice
 * first, which lasts until the (time_slice_ticks + 1)th tick from now. `next`, when not null,
 * is the slot of the fiber the caller polls next: it is prefetched meanwhile (prefetch_slot);
 * it must be a live slot, though its fiber may have finished. Nested polls (from a sync host
 * call's handler) restore the outer slot. */
int sym_fiber_poll(sym_fiber_slot *slot, uint64_t time_slice_ticks, const sym_fiber_slot *next) {
    if (next != 0)
        prefetch_slot(next);
    if (slot->future == 0) /* closed (fiber.py clears it): nothing left to run */
        return 1;
    if (time_slice_ticks) /* one more: the next tick may come at once (fiber.py's set_time_slice) */
        set_epoch_deadline(slot->context, time_slice_ticks + 1);
    sym_fiber_slot *outer = polled;
    polled = slot;
    slot->called = 0;
    bool finished = future_poll(slot->future);
    polled = outer;
    return finished ? 1 : (slot->called ? 2 : 0);
}

/* The epoch ticker: increments `engine`'s epoch every `interval_ns` until `*stop` is set. It
 * runs on a thread of its own, entered through ctypes (which releases the GIL for the call), so
 * a tick needs no interpreter: a tick in Python waited for the GIL, and made the thread holding
 * it wait in turn (fiber.py's EpochTicker has the measurements). The engine is a clone owned by
 * the caller, which deletes it once this returns; a process that exits with the ticker running
 * leaks it rather than free it under the loop. `nanosleep` is the C library's, passed in (this
 * file is built without one). */
typedef struct { int64_t seconds; int64_t nanoseconds; } sym_timespec; /* struct timespec, LP64 */
typedef int (*nanosleep_fn)(const sym_timespec *request, sym_timespec *remaining);
typedef void (*increment_epoch_fn)(void *engine);

void sym_ticker_run(void *engine, void *increment_epoch, void *nanosleep, const volatile uint32_t *stop,
                    uint64_t interval_ns) {
    /* An interval is slept in parts of at most 10 ms, so that a stop waits no longer than that. */
    uint64_t parts = (interval_ns + 9999999u) / 10000000u;
    uint64_t part_ns = interval_ns / (parts ? parts : 1);
    sym_timespec part = {(int64_t)(part_ns / 1000000000u), (int64_t)(part_ns % 1000000000u)};
    while (!*stop) {
        for (uint64_t i = 0; i < parts && !*stop; i++)
            ((nanosleep_fn)nanosleep)(&part, 0); /* a signal may end a part early: a tick early */
        if (*stop)
            break;
        ((increment_epoch_fn)increment_epoch)(engine);
    }
}
