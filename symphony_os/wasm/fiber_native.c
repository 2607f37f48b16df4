/* The C half of fiber.py: what wasmtime calls when a guest makes a host call, the poll that
 * runs a guest on, and the epoch ticker's loop. Python reaches it through ctypes (fiber.py loads
 * it, built by native_build.py with zig's clang).
 *
 * The slot (sym_fiber_slot, one per fiber) is the only memory the two halves share: fiber.py
 * declares it once as a ctypes Structure whose every offset is checked against this file's at
 * import (sym_fiber_slot_layout). Python reads a call's arguments from it and writes the answer
 * (results, or a trap) into it; C copies between the slot and wasmtime's own arrays, so Python
 * never touches memory wasmtime handed out by address.
 *
 * A blocking call's callback records the call (which function, its arguments, where its results
 * and trap go) in the polled fiber's slot and hands wasmtime a continuation that reads the
 * slot's `answered` byte; it calls nothing of Python's, so the call costs no callback into the
 * interpreter and runs nothing on the guest's cold fiber stack. `sym_fiber_poll` returns 2 when
 * the guest made such a call; fiber.py then runs the call's handler on its own stack, writes the
 * answer, raises `answered`, and the next poll resumes the guest, the continuation copying the
 * answer out. (Measured, 1024 guests each making one blocking call a round: 2.0 us per
 * guest-round, against 6.4-8.0 with the call answered through a ctypes callback.) A call that
 * never blocks runs its handler at once, through one ctypes callback taking the function's key
 * (sym_fiber_sync_call). A poll also prefetches what the caller's next poll will touch.
 *
 * A few calls come in one shape on almost every token (a LIP's decode step). fiber.py gives a
 * slot up to four such shapes (sym_fast_call: fixed and non-negative arguments, an output buffer
 * and one i32 read inside the guest's memory); a call in one of them is flagged as it is recorded
 * (fast_match), and Python's handler for it skips the decoding and checking that the shape
 * already guarantees. A call outside them, or one the handler declines, goes the ordinary way.
 *
 * Built with -nostdlib: it needs no C library, so zig compiles it in a tenth of a second
 * without building one first. wasmtime's functions arrive as pointers (`sym_fiber_init`). */
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SYM_FIBER_MAX_ARGS 16
#define SYM_FIBER_MAX_RESULTS 4
#define SYM_FIBER_HOST_OBJECTS 8
#define SYM_FIBER_MEMORY_HANDLE 24
#define SYM_FIBER_FAST_CALLS 4
#define SYM_FAST_NONE ((uint64_t)-1)

typedef struct { int64_t seconds; int64_t nanoseconds; } sym_timespec; /* struct timespec, LP64 */

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

/* A fast call's shape (fiber.py's FastCall). Unused entries have function 0. */
typedef struct {
    uint64_t function;            /* the host function's key */
    uint64_t fixed_mask;          /* bit i: args[i] must equal fixed[i] */
    uint64_t nonnegative_mask;    /* bit i: args[i] must be >= 0 */
    int32_t fixed[SYM_FIBER_MAX_ARGS];
    uint64_t read_arg;            /* the argument holding the address of an i32 to read (NONE: none) */
    uint64_t read_bound;          /* which must be in [0, bound) */
    uint64_t span_arg;            /* an output buffer: args[span] + span_scale * args[span + 1] in memory (NONE: none) */
    uint64_t span_scale;
} sym_fast_call;

/* One per fiber, owned by fiber.py's Fiber (its _Slot declares the same layout). */
typedef struct {
    void *future;          /* the call's wasmtime_call_future_t */
    void *context;         /* its store's context, for a fresh time slice */
    uint64_t called;       /* 1 once the guest made a blocking call in this poll */
    uint64_t function;     /* the called host function's key (its env) */
    void *caller;          /* the wasmtime_caller_t, alive while the guest waits in the call */
    sym_val *results;      /* where the call's results go (wasmtime's array) */
    void **trap_ret;       /* where a trap goes (wasm_trap_t **) */
    uint64_t nargs;
    uint8_t answered[8];   /* byte 0: the continuation's answer, raised once the answer is written */
    uint64_t nresults;
    void *trap;            /* the host's answer when it is a trap (a wasm_trap_t *), else null */
    sym_val args[SYM_FIBER_MAX_ARGS];    /* the call's arguments, copied here */
    sym_val answer[SYM_FIBER_MAX_RESULTS]; /* the host's results, copied to `results` */
    const char *stack;     /* where the guest's fiber stack was at its last blocking call (prefetch) */
    /* Host objects that handling its calls touches (fiber.py's `Fiber.prefetch_with`): their
       addresses and sizes, for prefetch_slot; unused entries are null. */
    const char *host_objects[SYM_FIBER_HOST_OBJECTS];
    uint64_t host_object_bytes[SYM_FIBER_HOST_OBJECTS];
    /* The fast calls (fiber.py's `Fiber.set_fast_call`): host functions whose common shape C
       recognises, so that Python takes them without decoding them (see fast_match). */
    sym_fast_call fast[SYM_FIBER_FAST_CALLS];
    const uint8_t *fast_memory;   /* the guest memory's base (it never moves) */
    uint8_t fast_memory_handle[SYM_FIBER_MEMORY_HANDLE]; /* its wasmtime_memory_t, for its size now */
    uint64_t fast_index;          /* the call just recorded: 1 + the index of its fast shape, or 0 */
    int64_t fast_value;           /* the i32 that shape reads, once recognised */
    /* The decode lane (lane_take_*, sym_lane_round). The host writes these only while lane_open
       is 0, except lane_open itself (a kill closes it from any thread). */
    uint64_t lane_open;           /* 0 closed, 1 open, 2 closed with counts for the host to take back */
    int64_t lane_kv;              /* the one KV handle whose decode steps it takes */
    int64_t lane_budget;          /* host calls it may still answer (up to the rate's next check) */
    int64_t lane_room;            /* tokens it may still queue (the KV page limit) */
    int64_t lane_ticket;          /* the next pred_submit ticket: the process's counter while open */
    uint64_t lane_pending;        /* 0 none; 1 a pred_submit answered, not queued yet; 2 the guest waits for it */
    int64_t lane_pending_ticket;  /* that pred's ticket (0: a blocking pred) */
    int64_t lane_token;           /* and its token */
    uint64_t lane_calls;          /* host calls answered since the host last took them */
    uint64_t lane_ns;             /* CPU time sym_lane_round charged since then */
    uint64_t lane_ns_limit;       /* past it, sym_lane_round polls no more (the CPU-time limit) */
    uint64_t lane_ticks;          /* the time slice a resumed guest gets */
    uint64_t lane_shapes[3];      /* 1 + the fast-call index of pred, pred_submit and pred_wait (0: none) */
} sym_fiber_slot;

typedef bool (*future_poll_fn)(void *future);
typedef void (*set_deadline_fn)(void *context, uint64_t ticks);
typedef void *(*trap_new_fn)(const char *message, size_t length);
typedef void *(*sync_handler_fn)(uint64_t function); /* fiber.py's: 0, or a trap */
typedef size_t (*memory_size_fn)(void *context, const void *memory);

static future_poll_fn future_poll;
static set_deadline_fn set_epoch_deadline;
static trap_new_fn trap_new;
static sync_handler_fn sync_handler;
static memory_size_fn memory_data_size;
static _Thread_local sym_fiber_slot *polled; /* the slot of the fiber this thread polls */

static const char NOT_POLLED[] = "a host function of a fiber was called outside Fiber.poll";
static const char TOO_MANY[] = "a host function of a fiber takes at most 16 arguments and 4 results";

void sym_fiber_init(void *poll, void *set_deadline, void *new_trap, void *handle_sync_call) {
    future_poll = (future_poll_fn)poll;
    set_epoch_deadline = (set_deadline_fn)set_deadline;
    trap_new = (trap_new_fn)new_trap;
    sync_handler = (sync_handler_fn)handle_sync_call;
}

void sym_fiber_init_memory_size(void *data_size) { memory_data_size = (memory_size_fn)data_size; }

/* The slot's size and each field's offset, in its order, for fiber.py to check its _Slot by. */
unsigned sym_fiber_slot_layout(uint32_t *out, unsigned cap) {
    const uint32_t layout[] = {
        sizeof(sym_fiber_slot), offsetof(sym_fiber_slot, future), offsetof(sym_fiber_slot, context),
        offsetof(sym_fiber_slot, called), offsetof(sym_fiber_slot, function), offsetof(sym_fiber_slot, caller),
        offsetof(sym_fiber_slot, results), offsetof(sym_fiber_slot, trap_ret), offsetof(sym_fiber_slot, nargs),
        offsetof(sym_fiber_slot, answered), offsetof(sym_fiber_slot, nresults), offsetof(sym_fiber_slot, trap),
        offsetof(sym_fiber_slot, args), offsetof(sym_fiber_slot, answer), offsetof(sym_fiber_slot, stack),
        offsetof(sym_fiber_slot, host_objects), offsetof(sym_fiber_slot, host_object_bytes),
        offsetof(sym_fiber_slot, fast), offsetof(sym_fiber_slot, fast_memory),
        offsetof(sym_fiber_slot, fast_memory_handle), offsetof(sym_fiber_slot, fast_index),
        offsetof(sym_fiber_slot, fast_value), offsetof(sym_fiber_slot, lane_open), offsetof(sym_fiber_slot, lane_kv),
        offsetof(sym_fiber_slot, lane_budget), offsetof(sym_fiber_slot, lane_room),
        offsetof(sym_fiber_slot, lane_ticket), offsetof(sym_fiber_slot, lane_pending),
        offsetof(sym_fiber_slot, lane_pending_ticket), offsetof(sym_fiber_slot, lane_token),
        offsetof(sym_fiber_slot, lane_calls), offsetof(sym_fiber_slot, lane_ns), offsetof(sym_fiber_slot, lane_ns_limit),
        offsetof(sym_fiber_slot, lane_ticks), offsetof(sym_fiber_slot, lane_shapes), sizeof(sym_fast_call), offsetof(sym_fast_call, fixed),
        offsetof(sym_fast_call, read_arg), SYM_FIBER_FAST_CALLS,
        SYM_FIBER_MAX_ARGS, SYM_FIBER_MAX_RESULTS, SYM_FIBER_HOST_OBJECTS, sizeof(sym_val), SYM_FIBER_MEMORY_HANDLE,
    };
    unsigned n = sizeof layout / sizeof layout[0];
    for (unsigned i = 0; i < n && i < cap; i++)
        out[i] = layout[i];
    return n;
}

/* The host's answer, from the slot to where wasmtime wants it: its trap, or its results. */
static void deliver(sym_fiber_slot *slot, sym_val *results, void **trap_ret) {
    if (slot->trap != 0) {
        *trap_ret = slot->trap;
        slot->trap = 0;
        return;
    }
    for (uint64_t i = 0; i < slot->nresults; i++)
        results[i] = slot->answer[i];
}

/* A blocking call's continuation (env: the slot): done once `answered` is raised. */
static bool read_answered(void *env) {
    sym_fiber_slot *slot = env;
    if (*(volatile uint8_t *)slot->answered == 0)
        return false;
    if (slot->lane_pending == 2) /* the lane's request, answered */
        slot->lane_pending = 0;
    deliver(slot, slot->results, slot->trap_ret);
    return true;
}

static bool answered_already(void *env) { (void)env; return true; }

/* Record a call in the polled fiber's slot; null (and a trap in *trap_ret) when there is no
   polled fiber or the call does not fit in the slot (fiber.py defines no function that does not). */
static sym_fiber_slot *record(void *env, void *caller, const sym_val *args, size_t nargs, sym_val *results,
                              size_t nresults, void **trap_ret) {
    sym_fiber_slot *slot = polled;
    if (slot == 0) {
        *trap_ret = trap_new(NOT_POLLED, sizeof(NOT_POLLED) - 1);
        return 0;
    }
    if (nargs > SYM_FIBER_MAX_ARGS || nresults > SYM_FIBER_MAX_RESULTS) {
        *trap_ret = trap_new(TOO_MANY, sizeof(TOO_MANY) - 1);
        return 0;
    }
    for (size_t i = 0; i < nargs; i++)
        slot->args[i] = args[i];
    slot->nargs = nargs;
    slot->nresults = nresults;
    slot->function = (uint64_t)(uintptr_t)env;
    slot->caller = caller;
    slot->results = results;
    slot->trap_ret = trap_ret;
    slot->trap = 0;
    return slot;
}

/* Is the call just recorded in `slot` one of its fast calls, in the shape Python set (fiber.py's
 * `Fiber.set_fast_call`): the fixed arguments equal, the others non-negative where asked, the
 * output buffer and the i32 read inside the guest's memory, the value read within its bound?
 * 1 + the shape's index (the value read in `fast_value`), or 0: an ordinary call, which Python
 * decodes and checks in full. This only ever sends a call the long way. */
static uint64_t fast_match(sym_fiber_slot *slot) {
    const sym_fast_call *shape = 0;
    uint64_t index = 0;
    for (; index < SYM_FIBER_FAST_CALLS; index++)
        if (slot->fast[index].function != 0 && slot->fast[index].function == slot->function) {
            shape = &slot->fast[index];
            break;
        }
    if (shape == 0 || memory_data_size == 0)
        return 0;
    int32_t args[SYM_FIBER_MAX_ARGS];
    for (uint64_t i = 0; i < slot->nargs; i++) {
        args[i] = *(const int32_t *)slot->args[i].of;
        if ((shape->fixed_mask >> i & 1) && args[i] != shape->fixed[i])
            return 0;
        if ((shape->nonnegative_mask >> i & 1) && args[i] < 0)
            return 0;
    }
    uint64_t size = memory_data_size(slot->context, slot->fast_memory_handle);
    if (shape->span_arg != SYM_FAST_NONE) {
        int32_t at = args[shape->span_arg], count = args[shape->span_arg + 1];
        if (at < 0 || count < 0 || (uint64_t)at + shape->span_scale * (uint64_t)count > size)
            return 0;
    }
    slot->fast_value = 0;
    if (shape->read_arg != SYM_FAST_NONE) {
        int32_t address = args[shape->read_arg];
        if (address < 0 || (uint64_t)address + 4 > size)
            return 0;
        const uint8_t *at = slot->fast_memory + address; /* little-endian, as wasm is */
        int32_t value = (int32_t)((uint32_t)at[0] | (uint32_t)at[1] << 8 | (uint32_t)at[2] << 16 | (uint32_t)at[3] << 24);
        if (value < 0 || (uint64_t)value >= shape->read_bound)
            return 0;
        slot->fast_value = value;
    }
    return index + 1;
}

/* The decode lane. A lane call is a fast call (fast_match) of the lane's shapes on its handle,
 * within its budget and room; anything else closes the lane and goes the ordinary way. */
enum { LANE_PRED, LANE_SUBMIT, LANE_WAIT };
#define LANE_LAST_TICKET 0x7ffffffe /* tickets are positive i32s */

static bool lane_close(sym_fiber_slot *slot) {
    slot->lane_open = 2;
    return false;
}

static int32_t arg_i32(const sym_fiber_slot *slot, unsigned index) { return *(const int32_t *)slot->args[index].of; }

/* A call that never blocks: a lane `pred_submit` is answered here (its ticket into `results`). */
static bool lane_take_sync(sym_fiber_slot *slot, sym_val *results) {
    if (slot->fast_index == 0 || slot->fast_index != slot->lane_shapes[LANE_SUBMIT] || slot->lane_pending != 0
        || arg_i32(slot, 0) != slot->lane_kv || slot->lane_budget < 2 || slot->lane_room < 1
        || slot->lane_ticket > LANE_LAST_TICKET) /* (budget 2: its pred_wait's call as well) */
        return lane_close(slot);
    int64_t ticket = slot->lane_ticket++;
    slot->lane_pending = 1;
    slot->lane_pending_ticket = ticket;
    slot->lane_token = slot->fast_value;
    slot->lane_budget--;
    slot->lane_room--;
    slot->lane_calls++;
    results[0].kind = 0; /* WASMTIME_I32 */
    *(int32_t *)results[0].of = (int32_t)ticket;
    return true;
}

/* A blocking call: `pred_wait` on the lane's pending ticket, or a blocking `pred` on its handle,
 * leaves the guest waiting with its request in the slot. */
static bool lane_take_blocking(sym_fiber_slot *slot) {
    uint64_t index = slot->fast_index;
    if (index == 0 || slot->lane_budget < 1)
        return lane_close(slot);
    if (index == slot->lane_shapes[LANE_WAIT]) {
        if (slot->lane_pending != 1 || arg_i32(slot, 0) != slot->lane_pending_ticket)
            return lane_close(slot);
    } else if (index == slot->lane_shapes[LANE_PRED]) {
        if (slot->lane_pending != 0 || arg_i32(slot, 0) != slot->lane_kv || slot->lane_room < 1)
            return lane_close(slot);
        slot->lane_pending_ticket = 0;
        slot->lane_token = slot->fast_value;
        slot->lane_room--;
    } else {
        return lane_close(slot);
    }
    slot->lane_pending = 2;
    slot->lane_budget--;
    slot->lane_calls++;
    return true;
}

/* wasmtime_func_async_callback_t of every blocking host function (env: the function's key). */
void sym_fiber_blocking_call(void *env, void *caller, const sym_val *args, size_t nargs, sym_val *results,
                             size_t nresults, void **trap_ret, sym_continuation *continuation) {
    sym_fiber_slot *slot = record(env, caller, args, nargs, results, nresults, trap_ret);
    continuation->finalizer = 0;
    if (slot == 0) {
        continuation->callback = answered_already;
        continuation->env = 0;
        return;
    }
    slot->stack = (const char *)__builtin_frame_address(0);
    slot->answered[0] = 0;
    slot->fast_index = fast_match(slot);
    if (slot->lane_open == 1 && lane_take_blocking(slot))
        slot->called = 4;
    else
        slot->called = slot->fast_index ? 3 : 1;
    continuation->callback = read_answered;
    continuation->env = slot;
}

/* wasmtime_func_callback_t of every host function that never blocks (env: the function's key):
   its handler runs now, in fiber.py, reading the arguments from the slot and writing the answer
   there. Its trap is the call's result. */
void *sym_fiber_sync_call(void *env, void *caller, const sym_val *args, size_t nargs, sym_val *results,
                          size_t nresults) {
    void *trap = 0;
    sym_fiber_slot *slot = record(env, caller, args, nargs, results, nresults, &trap);
    if (slot == 0)
        return trap;
    slot->fast_index = fast_match(slot);
    if (slot->lane_open == 1 && lane_take_sync(slot, results))
        return 0;
    void *failed = sync_handler(slot->function);
    if (failed != 0) {
        slot->trap = 0;
        return failed;
    }
    deliver(slot, results, &trap);
    return trap;
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
 * in the slot), 3 if that call is a fast call (fast_match; recorded all the same), 4 if it waits
 * in a decode-lane call (its request in the slot), 0 if it waits or yielded. A nonzero `time_slice_ticks` gives it a fresh slice
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
    return finished ? 1 : (slot->called >= 3 ? (int)slot->called : slot->called ? 2 : 0);
}

/* The clock sym_lane_round charges CPU time by: the C library's clock_gettime, passed in. */
typedef int (*clock_gettime_fn)(int clock, sym_timespec *now);
static clock_gettime_fn clock_gettime_of_libc;
#define SYM_CLOCK_MONOTONIC 1

void sym_lane_init(void *clock_gettime) { clock_gettime_of_libc = (clock_gettime_fn)clock_gettime; }

static uint64_t now_ns(void) {
    sym_timespec now;
    clock_gettime_of_libc(SYM_CLOCK_MONOTONIC, &now);
    return (uint64_t)now.seconds * 1000000000u + (uint64_t)now.nanoseconds;
}

/* The decode lane's round: resume each of `slots` (guests whose lane request was answered),
 * each with a fresh time slice, until its next lane request: its index goes into `requests`
 * and its handle and token into `kvs` and `tokens`; the number of them is returned. A guest
 * that did anything else (another call, a yield, the end), or was not polled (its lane closed,
 * its fiber closed, past its CPU time), goes into `others` with poll's answer (-1: not polled),
 * `*n_others` of them, for the host to go on with as after its own poll. Each guest is charged
 * its wall time times `scale_q16` / 65536 (the thread's CPU share) in lane_ns. */
uint64_t sym_lane_round(sym_fiber_slot *const *slots, uint64_t n, uint64_t scale_q16, uint32_t *requests,
                        int32_t *kvs, int32_t *tokens, uint32_t *others, int32_t *states, uint64_t *n_others) {
    uint64_t asked = 0, other = 0;
    uint64_t started = now_ns();
    for (uint64_t i = 0; i < n; i++) {
        sym_fiber_slot *slot = slots[i];
        if (i + 1 < n)
            prefetch_slot(slots[i + 1]);
        if (slot->future == 0 || slot->lane_open != 1 || slot->lane_ns >= slot->lane_ns_limit
            || *(volatile uint8_t *)slot->answered == 0) {
            if (slot->lane_open == 1 && slot->lane_ns >= slot->lane_ns_limit)
                slot->lane_open = 2;
            others[other] = (uint32_t)i;
            states[other++] = -1;
            continue;
        }
        if (slot->lane_ticks)
            set_epoch_deadline(slot->context, slot->lane_ticks + 1);
        sym_fiber_slot *outer = polled;
        polled = slot;
        slot->called = 0;
        bool finished = future_poll(slot->future);
        polled = outer;
        uint64_t ended = now_ns();
        slot->lane_ns += ((ended - started) * scale_q16) >> 16;
        started = ended;
        if (!finished && slot->called == 4) {
            requests[asked] = (uint32_t)i;
            kvs[asked] = (int32_t)slot->lane_kv;
            tokens[asked++] = (int32_t)slot->lane_token;
        } else {
            others[other] = (uint32_t)i;
            states[other++] = finished ? 1 : (slot->called >= 3 ? (int)slot->called : slot->called ? 2 : 0);
        }
    }
    *n_others = other;
    return asked;
}

/* The slot of the fiber this thread polls (0: none): how a host call made during
   sym_lane_round finds its fiber. */
sym_fiber_slot *sym_fiber_polled(void) { return polled; }

/* The epoch ticker: increments `engine`'s epoch every `interval_ns` until `*stop` is set. It
 * runs on a thread of its own, entered through ctypes (which releases the GIL for the call), so
 * a tick needs no interpreter: a tick in Python waited for the GIL, and made the thread holding
 * it wait in turn (fiber.py's EpochTicker has the measurements). The engine is a clone owned by
 * the caller, which deletes it once this returns; a process that exits with the ticker running
 * leaks it rather than free it under the loop. `nanosleep` is the C library's, passed in (this
 * file is built without one). */
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
