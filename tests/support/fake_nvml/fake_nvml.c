/*
 * FAKE libnvidia-ml.so.1 -- a TEST DOUBLE for infersight's test suite.
 * It is NOT NVIDIA's NVML and talks to no hardware. It implements only the
 * entry points infersight.agent.nvml calls, with the struct layouts of nvml.h
 * (nvmlMemory_t, nvmlUtilization_t, nvmlProcessInfo_v2_t, nvmlEventData_t), so
 * that nvidia-ml-py's real ctypes bindings drive it through LD_LIBRARY_PATH.
 *
 * Configuration: FAKE_NVML_CONFIG names a text file of lines
 *     count <n>
 *     <index> <key> <value>
 * '#' starts a comment. Numeric keys take a decimal/hex number, or '-' for
 * NVML_ERROR_NOT_SUPPORTED. Keys: see the table in fake_set() below.
 * 'lost_after N' makes every device query after the N-th return
 * NVML_ERROR_GPU_IS_LOST. 'hang_after N' makes every device query after the N-th
 * block while the file named by FAKE_NVML_HANG_FILE exists (a driver that stops
 * answering, as NVML calls do on a GPU that fell off the bus), creating
 * "<file>.entered" as it starts to; the test ends the hang by removing the file.
 * A line 'hang_init 1' makes nvmlInit itself block so. 'xid C' queues an Xid event with data C.
 * 'procs pid:bytes,pid:bytes' lists compute processes.
 * 'procutil pid:sm:mem,...' lists the per-process utilisation samples that the FAKE
 * nvmlDeviceGetProcessUtilization returns (no real sampling: the same values each call),
 * stamped with the current time in microseconds, or with 'procutil_ts N' (then a second
 * call, asking for samples newer than N, gets NVML_ERROR_NOT_FOUND); 'procutil_ts -'
 * makes the call NVML_ERROR_NOT_SUPPORTED (as on GPUs without it, and MIG).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_GPU_IS_LOST = 15, NVML_ERROR_UNKNOWN = 999
};

/* nvml.h layouts */
typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct nvmlEventSet_st *nvmlEventSet_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;
typedef struct {
    unsigned int pid;
    unsigned long long timeStamp;
    unsigned int smUtil, memUtil, encUtil, decUtil;
} nvmlProcessUtilizationSample_t;
typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

#define NS (-1LL) /* not supported */
#define MAXDEV 8
#define MAXPROC 16
#define MAXXID 16
#define MAXLINK 18

enum {
    F_UTIL_GPU, F_UTIL_MEM, F_MEM_TOTAL, F_MEM_USED, F_CLK_SM, F_CLK_SM_MAX, F_CLK_MEM,
    F_CLK_MEM_MAX, F_POWER_MW, F_POWER_LIMIT_MW, F_TEMP, F_THROTTLE, F_PCIE_GEN,
    F_PCIE_GEN_MAX, F_PCIE_WIDTH, F_PCIE_WIDTH_MAX, F_PCIE_REPLAY, F_ECC_CORR, F_ECC_UNCORR,
    F_RETIRED_SBE, F_RETIRED_DBE, F_REMAP_CORR, F_REMAP_UNCORR, F_REMAP_PENDING,
    F_REMAP_FAILURE, F_NVLINKS, F_NVLINK_DOWN, F_LOST_AFTER, F_PROCUTIL_TS, F_HANG_AFTER, F_COUNT
};
static const char *field_names[F_COUNT] = {
    "util_gpu", "util_mem", "mem_total", "mem_used", "clk_sm", "clk_sm_max", "clk_mem",
    "clk_mem_max", "power_mw", "power_limit_mw", "temp", "throttle", "pcie_gen",
    "pcie_gen_max", "pcie_width", "pcie_width_max", "pcie_replay", "ecc_corr", "ecc_uncorr",
    "retired_sbe", "retired_dbe", "remap_corr", "remap_uncorr", "remap_pending",
    "remap_failure", "nvlinks", "nvlink_down", "lost_after", "procutil_ts", "hang_after"
};
/* a healthy, idle-free device */
static const long long defaults[F_COUNT] = {
    50, 20, 80LL << 30, 10LL << 30, 1980, 1980, 2619, 2619, 300000, 700000, 55, 0, 5, 5, 16,
    16, 0, 0, 0, NS, NS, 0, 0, 0, 0, 0, 0, -1, 0, -1
};

struct fake_dev {
    struct fake_dev *self; /* handles are pointers to these */
    char uuid[96];
    char name[96];
    long long f[F_COUNT];
    long long calls;
    unsigned int nproc;
    nvmlProcessInfo_v2_t procs[MAXPROC];
    unsigned int nutil;
    nvmlProcessUtilizationSample_t util[MAXPROC];
};
static struct fake_dev devs[MAXDEV];
static unsigned int ndev = 0;
static int initialised = 0;
static unsigned int hang_init = 0; /* 'hang_init 1': nvmlInit blocks like a device query after hang_after */
static unsigned long long xid_data[MAXXID];
static unsigned int xid_dev[MAXXID];
static unsigned int nxid = 0, xid_next = 0;
static int event_set_token;

static void fake_set(unsigned int i, const char *key, const char *val) {
    if (i >= MAXDEV) return;
    struct fake_dev *d = &devs[i];
    if (!strcmp(key, "uuid")) { snprintf(d->uuid, sizeof d->uuid, "%s", val); return; }
    if (!strcmp(key, "name")) { snprintf(d->name, sizeof d->name, "%s", val); return; }
    if (!strcmp(key, "xid")) {
        if (nxid < MAXXID) { xid_dev[nxid] = i; xid_data[nxid++] = strtoull(val, NULL, 0); }
        return;
    }
    if (!strcmp(key, "procs")) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", val);
        for (char *tok = strtok(buf, ","); tok && d->nproc < MAXPROC; tok = strtok(NULL, ",")) {
            nvmlProcessInfo_v2_t *p = &d->procs[d->nproc++];
            p->pid = (unsigned int)strtoul(tok, &tok, 10);
            p->usedGpuMemory = (*tok == ':') ? strtoull(tok + 1, NULL, 0) : 0;
            p->gpuInstanceId = p->computeInstanceId = 0xFFFFFFFFu;
        }
        return;
    }
    if (!strcmp(key, "procutil")) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s", val);
        for (char *tok = strtok(buf, ","); tok && d->nutil < MAXPROC; tok = strtok(NULL, ",")) {
            nvmlProcessUtilizationSample_t *u = &d->util[d->nutil++];
            memset(u, 0, sizeof *u);
            u->pid = (unsigned int)strtoul(tok, &tok, 10);
            if (*tok == ':') u->smUtil = (unsigned int)strtoul(tok + 1, &tok, 10);
            if (*tok == ':') u->memUtil = (unsigned int)strtoul(tok + 1, &tok, 10);
        }
        return;
    }
    for (int k = 0; k < F_COUNT; k++) {
        if (!strcmp(key, field_names[k])) {
            d->f[k] = (val[0] == '-' && val[1] == '\0') ? NS : strtoll(val, NULL, 0);
            return;
        }
    }
    fprintf(stderr, "fake_nvml: unknown key '%s'\n", key);
}

static void fake_load(void) {
    ndev = 2;
    hang_init = 0;
    nxid = xid_next = 0;
    for (unsigned int i = 0; i < MAXDEV; i++) {
        memset(&devs[i], 0, sizeof devs[i]);
        devs[i].self = &devs[i];
        memcpy(devs[i].f, defaults, sizeof defaults);
        snprintf(devs[i].uuid, sizeof devs[i].uuid,
                 "GPU-fa4e0000-0000-4000-8000-00000000000%u", i);
        snprintf(devs[i].name, sizeof devs[i].name, "FAKE NVIDIA GPU (fake_nvml)");
    }
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *fp = path ? fopen(path, "r") : NULL;
    if (!fp) return;
    char line[1024];
    while (fgets(line, sizeof line, fp)) {
        char *hash = strchr(line, '#');
        if (hash) *hash = '\0';
        line[strcspn(line, "\r\n")] = '\0';
        char key[64], rest[900];
        unsigned int idx;
        if (sscanf(line, " count %u", &idx) == 1) { ndev = idx > MAXDEV ? MAXDEV : idx; continue; }
        if (sscanf(line, " hang_init %u", &idx) == 1) { hang_init = idx; continue; }
        if (sscanf(line, " %u %63s %899[^\n]", &idx, key, rest) == 3) {
            char *end = rest + strlen(rest);
            while (end > rest && (end[-1] == ' ' || end[-1] == '\t')) *--end = '\0';
            fake_set(idx, key, rest);
        }
    }
    fclose(fp);
}

/* Block while FAKE_NVML_HANG_FILE exists, creating "<file>.entered" first. */
static void hang_while_file(void) {
    const char *hang = getenv("FAKE_NVML_HANG_FILE");
    struct timespec tick = {0, 10 * 1000 * 1000};
    if (!hang || access(hang, F_OK) != 0) return;
    char entered[4096];
    snprintf(entered, sizeof entered, "%s.entered", hang);
    FILE *mark = fopen(entered, "w");
    if (mark) fclose(mark);
    while (access(hang, F_OK) == 0) nanosleep(&tick, NULL);
}

/* Every device query goes through here: validity, lost-after countdown. */
static nvmlReturn_t dev_check(nvmlDevice_t h, struct fake_dev **out) {
    struct fake_dev *d = (struct fake_dev *)h;
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (!d || d < devs || d >= devs + ndev || d->self != d) return NVML_ERROR_INVALID_ARGUMENT;
    d->calls++;
    if (d->f[F_LOST_AFTER] >= 0 && d->calls > d->f[F_LOST_AFTER]) return NVML_ERROR_GPU_IS_LOST;
    if (d->f[F_HANG_AFTER] >= 0 && d->calls > d->f[F_HANG_AFTER]) hang_while_file();
    *out = d;
    return NVML_SUCCESS;
}

static nvmlReturn_t get_uint(nvmlDevice_t h, int field, unsigned int *out) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->f[field] == NS) return NVML_ERROR_NOT_SUPPORTED;
    *out = (unsigned int)d->f[field];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    fake_load();
    if (hang_init) hang_while_file();
    initialised = 1;
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { initialised = 0; return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    default: return "Unknown Error (fake_nvml)";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    snprintf(version, length, "0.0.fake");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *count = ndev;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (index >= ndev) return NVML_ERROR_INVALID_ARGUMENT;
    *device = (nvmlDevice_t)&devs[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    snprintf(uuid, length, "%s", d->uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    snprintf(name, length, "%s", d->name);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (d->f[F_UTIL_GPU] == NS) return NVML_ERROR_NOT_SUPPORTED;
    u->gpu = (unsigned int)d->f[F_UTIL_GPU];
    u->memory = (unsigned int)d->f[F_UTIL_MEM];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    m->total = (unsigned long long)d->f[F_MEM_TOTAL];
    m->used = (unsigned long long)d->f[F_MEM_USED];
    m->free = m->total - m->used;
    return NVML_SUCCESS;
}

/* nvmlClockType_t: 0 graphics, 1 SM, 2 memory */
nvmlReturn_t nvmlDeviceGetClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    return get_uint(h, type == 2 ? F_CLK_MEM : F_CLK_SM, clock);
}
nvmlReturn_t nvmlDeviceGetMaxClockInfo(nvmlDevice_t h, int type, unsigned int *clock) {
    return get_uint(h, type == 2 ? F_CLK_MEM_MAX : F_CLK_SM_MAX, clock);
}
nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t h, unsigned int *mw) { return get_uint(h, F_POWER_MW, mw); }
nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t h, unsigned int *mw) { return get_uint(h, F_POWER_LIMIT_MW, mw); }
nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t h, int sensor, unsigned int *t) { (void)sensor; return get_uint(h, F_TEMP, t); }
nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t h, unsigned int *v) { return get_uint(h, F_PCIE_GEN, v); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t h, unsigned int *v) { return get_uint(h, F_PCIE_GEN_MAX, v); }
nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t h, unsigned int *v) { return get_uint(h, F_PCIE_WIDTH, v); }
nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t h, unsigned int *v) { return get_uint(h, F_PCIE_WIDTH_MAX, v); }
nvmlReturn_t nvmlDeviceGetPcieReplayCounter(nvmlDevice_t h, unsigned int *v) { return get_uint(h, F_PCIE_REPLAY, v); }

/* A driver before R535 (compiled with -DFAKE_NVML_PRE_R535) exports this call under its
 * older name only; nvidia-ml-py then raises NVML_ERROR_FUNCTION_NOT_FOUND for the new one. */
#ifdef FAKE_NVML_PRE_R535
nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t h, unsigned long long *mask) {
#else
nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t h, unsigned long long *mask) {
#endif
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (d->f[F_THROTTLE] == NS) return NVML_ERROR_NOT_SUPPORTED;
    *mask = (unsigned long long)d->f[F_THROTTLE];
    return NVML_SUCCESS;
}

/* errorType 0 corrected, 1 uncorrected; counterType 0 volatile */
nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t h, int errorType, int counterType,
                                         unsigned long long *count) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    (void)counterType;
    long long v = d->f[errorType == 1 ? F_ECC_UNCORR : F_ECC_CORR];
    if (v == NS) return NVML_ERROR_NOT_SUPPORTED;
    *count = (unsigned long long)v;
    return NVML_SUCCESS;
}

/* cause 0 multiple single-bit, 1 double-bit; fills fake page addresses */
nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t h, int cause, unsigned int *count,
                                       unsigned long long *addresses) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    long long n = d->f[cause == 1 ? F_RETIRED_DBE : F_RETIRED_SBE];
    if (n == NS) return NVML_ERROR_NOT_SUPPORTED;
    if (!addresses || *count < (unsigned int)n) { *count = (unsigned int)n; return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS; }
    for (long long k = 0; k < n; k++) addresses[k] = 0x1000ULL * (unsigned long long)(k + 1);
    *count = (unsigned int)n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t h, unsigned int *corr, unsigned int *unc,
                                       unsigned int *pending, unsigned int *failure) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (d->f[F_REMAP_CORR] == NS) return NVML_ERROR_NOT_SUPPORTED;
    *corr = (unsigned int)d->f[F_REMAP_CORR];
    *unc = (unsigned int)d->f[F_REMAP_UNCORR];
    *pending = (unsigned int)d->f[F_REMAP_PENDING];
    *failure = (unsigned int)d->f[F_REMAP_FAILURE];
    return NVML_SUCCESS;
}

/* nvlinks N links exist; bit k of nvlink_down marks link k inactive */
nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t h, unsigned int link, unsigned int *active) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (d->f[F_NVLINKS] == NS || link >= (unsigned long long)d->f[F_NVLINKS] || link >= MAXLINK)
        return NVML_ERROR_NOT_SUPPORTED;
    *active = ((unsigned long long)d->f[F_NVLINK_DOWN] >> link) & 1ULL ? 0 : 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
                                                     nvmlProcessInfo_v2_t *infos) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (d->nproc == 0) { *count = 0; return NVML_SUCCESS; }
    if (!infos || *count < d->nproc) { *count = d->nproc; return NVML_ERROR_INSUFFICIENT_SIZE; }
    memcpy(infos, d->procs, d->nproc * sizeof *infos);
    *count = d->nproc;
    return NVML_SUCCESS;
}

/* FAKE: the configured 'procutil' samples, newer than lastSeen or NVML_ERROR_NOT_FOUND. As
 * nvidia-ml-py expects of the real library: a NULL buffer (or one too small) gets the count
 * and NVML_ERROR_INSUFFICIENT_SIZE. */
nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t h, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *count, unsigned long long lastSeen) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    if (!count) return NVML_ERROR_INVALID_ARGUMENT;
    if (d->f[F_PROCUTIL_TS] == NS) return NVML_ERROR_NOT_SUPPORTED;
    unsigned long long ts = (unsigned long long)d->f[F_PROCUTIL_TS];
    if (ts == 0) {
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        ts = (unsigned long long)now.tv_sec * 1000000ULL + (unsigned long long)now.tv_nsec / 1000ULL;
    }
    if (d->nutil == 0 || ts <= lastSeen) return NVML_ERROR_NOT_FOUND;
    if (!utilization || *count < d->nutil) { *count = d->nutil; return NVML_ERROR_INSUFFICIENT_SIZE; }
    for (unsigned int k = 0; k < d->nutil; k++) {
        utilization[k] = d->util[k];
        utilization[k].timeStamp = ts;
    }
    *count = d->nutil;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetSupportedEventTypes(nvmlDevice_t h, unsigned long long *types) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    if (r) return r;
    *types = 0x1ULL | 0x2ULL | 0x8ULL; /* single/double bit ECC, Xid */
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    *set = (nvmlEventSet_t)&event_set_token;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t h, unsigned long long types, nvmlEventSet_t set) {
    struct fake_dev *d;
    nvmlReturn_t r = dev_check(h, &d);
    (void)types;
    if (r) return r;
    return set == (nvmlEventSet_t)&event_set_token ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
}

/* Pops one queued Xid per call; otherwise sleeps (at most 20 ms) and times out. */
nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!initialised) return NVML_ERROR_UNINITIALIZED;
    if (set != (nvmlEventSet_t)&event_set_token) return NVML_ERROR_INVALID_ARGUMENT;
    if (xid_next < nxid) {
        memset(data, 0, sizeof *data);
        data->device = (nvmlDevice_t)&devs[xid_dev[xid_next]];
        data->eventType = 0x8ULL;
        data->eventData = xid_data[xid_next++];
        data->gpuInstanceId = data->computeInstanceId = 0xFFFFFFFFu;
        return NVML_SUCCESS;
    }
    unsigned int ms = timeoutms < 20 ? timeoutms : 20;
    struct timespec ts = { ms / 1000, (long)(ms % 1000) * 1000000L };
    nanosleep(&ts, NULL);
    return NVML_ERROR_TIMEOUT;
}

nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) { (void)set; return NVML_SUCCESS; }
