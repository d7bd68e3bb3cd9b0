/* A stand-in for NVIDIA's libnvidia-ml (NVML) for machines without a GPU.
 *
 * It exports the NVML calls profstream makes (the device sampler through nvidia-ml-py's
 * pynvml, `profstream doctor` through ctypes) with the signatures and structures of
 * nvml.h, and answers them from values the tests set: through the double_* functions
 * (ctypes, in the test process) or the NVML_DOUBLE variable, read at init (in a child
 * process): "devices=2,gpu_util=70,power_mw=250000,fail_power_mw=3,lose_after=5".
 *
 * Quantities are per device; a quantity set to fail returns that NVML error code from
 * every call reading it (per entry for nvmlDeviceGetFieldValues); a lost device answers
 * NVML_ERROR_GPU_IS_LOST (15) everywhere. PCIe and NVLink are cumulative counters that
 * grow at the rate set (bytes/s) from the moment it is set, as the real ones do.
 * tests/nvml.py builds it and wraps it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_DEVICES 8
#define SUCCESS 0
#define ERROR_UNINITIALIZED 1
#define ERROR_INVALID_ARGUMENT 2
#define ERROR_NOT_SUPPORTED 3
#define ERROR_NOT_FOUND 6
#define ERROR_GPU_IS_LOST 15

enum quantity {
    GPU_UTIL, MEM_UTIL, MEM_USED, MEM_TOTAL, POWER_MW, POWER_LIMIT_MW, TEMPERATURE, SM_CLOCK,
    REASONS, PCIE_TX_RATE, PCIE_RX_RATE, NVLINK_TX_RATE, NVLINK_RX_RATE, PCIE_THROUGHPUT,
    QUANTITIES
};
static const char *names[QUANTITIES] = {
    "gpu_util", "mem_util", "mem_used", "mem_total", "power_mw", "power_limit_mw", "temperature",
    "sm_clock", "reasons", "pcie_tx_rate", "pcie_rx_rate", "nvlink_tx_rate", "nvlink_rx_rate",
    "pcie_throughput"
};

struct device {
    double value[QUANTITIES];
    double since[QUANTITIES]; /* when a rate was set: its counter starts at 0 there */
    int fail[QUANTITIES];
    long calls[QUANTITIES];
    int lost;
    long lose_after; /* reads of GPU_UTIL before the device is lost; <0 never */
};

static struct device devices[MAX_DEVICES];
static unsigned device_count = 1;
static int initialised;
static int configured; /* set by double_reset: NVML_DOUBLE is not read then */

typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef union { double d; unsigned ui; unsigned long ul; unsigned long long ull; long long sll; int si; unsigned short us; } nvmlValue_t;
typedef struct {
    unsigned fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned valueType, nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;
typedef struct device *nvmlDevice_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void defaults(unsigned count) {
    device_count = count > MAX_DEVICES ? MAX_DEVICES : count;
    memset(devices, 0, sizeof devices);
    double t = now_s();
    for (unsigned i = 0; i < MAX_DEVICES; i++) {
        struct device *d = &devices[i];
        d->value[GPU_UTIL] = 50; d->value[MEM_UTIL] = 20;
        d->value[MEM_USED] = 1e9; d->value[MEM_TOTAL] = 80e9;
        d->value[POWER_MW] = 200000; d->value[POWER_LIMIT_MW] = 700000;
        d->value[TEMPERATURE] = 45; d->value[SM_CLOCK] = 1980; d->value[REASONS] = 0;
        for (int q = 0; q < QUANTITIES; q++) d->since[q] = t;
        d->lose_after = -1;
    }
}

/* -- control, for the tests ------------------------------------------------------ */

void double_reset(unsigned count) { defaults(count); configured = 1; }

int double_set(unsigned dev, int q, double value) {
    if (dev >= MAX_DEVICES || q < 0 || q >= QUANTITIES) return -1;
    devices[dev].value[q] = value;
    devices[dev].since[q] = now_s();
    return 0;
}

int double_fail(unsigned dev, int q, int code) {
    if (dev >= MAX_DEVICES || q < 0 || q >= QUANTITIES) return -1;
    devices[dev].fail[q] = code;
    return 0;
}

void double_lose(unsigned dev) { if (dev < MAX_DEVICES) devices[dev].lost = 1; }

long double_calls(unsigned dev, int q) {
    return dev < MAX_DEVICES && q >= 0 && q < QUANTITIES ? devices[dev].calls[q] : -1;
}

static int quantity_named(const char *name, size_t len) {
    for (int q = 0; q < QUANTITIES; q++)
        if (strlen(names[q]) == len && strncmp(names[q], name, len) == 0) return q;
    return -1;
}

/* NVML_DOUBLE: comma-separated key=value, applied to every device. */
static void configure_from_environment(void) {
    const char *spec = getenv("NVML_DOUBLE");
    defaults(1);
    if (spec == NULL) return;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", spec);
    for (char *item = strtok(buf, ","); item != NULL; item = strtok(NULL, ",")) {
        char *eq = strchr(item, '=');
        if (eq == NULL) continue;
        *eq = '\0';
        double value = atof(eq + 1);
        if (strcmp(item, "devices") == 0) { device_count = (unsigned)value; continue; }
        for (unsigned i = 0; i < MAX_DEVICES; i++) {
            if (strcmp(item, "lose_after") == 0) devices[i].lose_after = (long)value;
            else if (strncmp(item, "fail_", 5) == 0) {
                int q = quantity_named(item + 5, strlen(item + 5));
                if (q >= 0) devices[i].fail[q] = (int)value;
            } else {
                int q = quantity_named(item, strlen(item));
                if (q >= 0) devices[i].value[q] = value;
            }
        }
    }
}

/* -- NVML ------------------------------------------------------------------------ */

int nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    if (!configured && !initialised) configure_from_environment();
    initialised++;
    return SUCCESS;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) {
    if (!initialised) return ERROR_UNINITIALIZED;
    initialised--;
    return SUCCESS;
}

const char *nvmlErrorString(int code) {
    switch (code) {
        case SUCCESS: return "Success";
        case ERROR_NOT_SUPPORTED: return "Not Supported";
        case ERROR_GPU_IS_LOST: return "GPU is lost";
        default: return "Unknown Error";
    }
}

int nvmlDeviceGetCount_v2(unsigned *count) {
    if (!initialised) return ERROR_UNINITIALIZED;
    *count = device_count;
    return SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned index, nvmlDevice_t *device) {
    if (!initialised) return ERROR_UNINITIALIZED;
    if (index >= device_count) return ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return SUCCESS;
}

static void uuid_of(unsigned index, char *out, unsigned len) {
    snprintf(out, len, "GPU-d0b1e000-0000-4000-8000-%012u", index);
}

int nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned len) {
    uuid_of((unsigned)(device - devices), uuid, len);
    return SUCCESS;
}

int nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    char mine[96];
    for (unsigned i = 0; i < device_count; i++) {
        uuid_of(i, mine, sizeof mine);
        if (strcmp(mine, uuid) == 0) { *device = &devices[i]; return SUCCESS; }
    }
    return ERROR_NOT_FOUND;
}

int nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned len) {
    snprintf(name, len, "NVML double %u", (unsigned)(device - devices));
    return SUCCESS;
}

/* The error code a read of q answers, counting the call; 0 when it succeeds. */
static int reading(nvmlDevice_t d, int q) {
    if (!initialised) return ERROR_UNINITIALIZED;
    d->calls[q]++;
    if (q == GPU_UTIL && d->lose_after >= 0 && d->calls[q] > d->lose_after) d->lost = 1;
    if (d->lost) return ERROR_GPU_IS_LOST;
    return d->fail[q];
}

int nvmlDeviceGetUtilizationRates(nvmlDevice_t d, nvmlUtilization_t *util) {
    int rc = reading(d, GPU_UTIL);
    if (rc) return rc;
    util->gpu = (unsigned)d->value[GPU_UTIL];
    util->memory = (unsigned)d->value[MEM_UTIL];
    return SUCCESS;
}

int nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *mem) {
    int rc = reading(d, MEM_USED);
    if (rc) return rc;
    mem->total = (unsigned long long)d->value[MEM_TOTAL];
    mem->used = (unsigned long long)d->value[MEM_USED];
    mem->free = mem->total - mem->used;
    return SUCCESS;
}

static int read_uint(nvmlDevice_t d, int q, unsigned *out) {
    int rc = reading(d, q);
    if (rc) return rc;
    *out = (unsigned)d->value[q];
    return SUCCESS;
}

int nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned *mw) { return read_uint(d, POWER_MW, mw); }
int nvmlDeviceGetEnforcedPowerLimit(nvmlDevice_t d, unsigned *mw) { return read_uint(d, POWER_LIMIT_MW, mw); }
int nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned *c) {
    return sensor == 0 ? read_uint(d, TEMPERATURE, c) : ERROR_INVALID_ARGUMENT;
}
int nvmlDeviceGetClockInfo(nvmlDevice_t d, int type, unsigned *mhz) {
    return type == 1 ? read_uint(d, SM_CLOCK, mhz) : ERROR_INVALID_ARGUMENT;
}

int nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *reasons) {
    int rc = reading(d, REASONS);
    if (rc) return rc;
    *reasons = (unsigned long long)d->value[REASONS];
    return SUCCESS;
}

static double counter(nvmlDevice_t d, int q, double t) { return d->value[q] * (t - d->since[q]); }

int nvmlDeviceGetPcieThroughput(nvmlDevice_t d, int which, unsigned *kb_per_s) {
    int rc = reading(d, PCIE_THROUGHPUT);
    if (rc) return rc;
    *kb_per_s = (unsigned)(d->value[which == 0 ? PCIE_TX_RATE : PCIE_RX_RATE] / 1024);
    return SUCCESS;
}

int nvmlDeviceGetFieldValues(nvmlDevice_t d, int count, nvmlFieldValue_t *values) {
    if (!initialised) return ERROR_UNINITIALIZED;
    if (d->lost) return ERROR_GPU_IS_LOST;
    double t = now_s();
    for (int i = 0; i < count; i++) {
        nvmlFieldValue_t *v = &values[i];
        int q, kib = 0;
        switch (v->fieldId) {
            case 197: q = PCIE_TX_RATE; break;              /* NVML_FI_DEV_PCIE_COUNT_TX_BYTES */
            case 198: q = PCIE_RX_RATE; break;              /* NVML_FI_DEV_PCIE_COUNT_RX_BYTES */
            case 138: q = NVLINK_TX_RATE; kib = 1; break;   /* NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX */
            case 139: q = NVLINK_RX_RATE; kib = 1; break;   /* NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX */
            default: v->nvmlReturn = ERROR_NOT_SUPPORTED; continue;
        }
        d->calls[q]++;
        v->timestamp = (long long)(t * 1e6);
        v->latencyUsec = 0;
        v->nvmlReturn = d->fail[q];
        if (v->nvmlReturn) continue;
        v->valueType = 3; /* NVML_VALUE_TYPE_UNSIGNED_LONG_LONG */
        v->value.ull = (unsigned long long)(counter(d, q, t) / (kib ? 1024 : 1));
    }
    return SUCCESS;
}
