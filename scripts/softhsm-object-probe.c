/*
 * Where SoftHSM's cost goes when several threads of one process sign: the
 * bare C_SignInit/C_Sign (CKM_ECDSA) loop, one session per thread, with either
 * the imported token key (an object in SoftHSM's file store) or a P-256 key
 * generated in each thread's session (CKA_TOKEN false: in memory only). The
 * difference is SoftHSM's file object store, which re-reads the token's
 * generation file on each use of a token object (one openat, fstat, read,
 * close and three fcntl locks per signature: count them with strace -c -f)
 * while it holds the object's and the token's mutexes. An experiment for
 * docs/BENCHMARKS.md ("Twenty-seventh round"), not part of signerd.
 *
 *   cc -O2 scripts/softhsm-object-probe.c -o /tmp/softhsm-object-probe -ldl -lpthread
 *   SOFTHSM2_CONF=... /tmp/softhsm-object-probe /usr/lib/softhsm/libsofthsm2.so TOKEN_LABEL KEY_ID PIN_FILE token|session THREADS SECONDS
 *
 * The PIN is read from PIN_FILE, never from the command line. Signatures are
 * not verified here: signerd's tests and `signctl bench --verify` do that.
 */
#include <dlfcn.h>
#include <p11-kit-1/p11-kit/pkcs11.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static CK_FUNCTION_LIST_PTR p11;
static CK_SLOT_ID slot;
static CK_OBJECT_HANDLE token_key;
static int session_keys;
static volatile int stopping;

struct worker { pthread_t thread; unsigned long signatures; CK_RV failure; };

static double seconds_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static void *sign_loop(void *argument) {
    struct worker *w = argument;
    CK_SESSION_HANDLE session;
    CK_RV rv = p11->C_OpenSession(slot, CKF_SERIAL_SESSION, NULL, NULL, &session);
    if (rv != CKR_OK) { w->failure = rv; return NULL; }
    CK_OBJECT_HANDLE key = token_key;
    if (session_keys) {
        static const unsigned char prime256v1[] = {0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07};
        CK_BBOOL no = CK_FALSE, yes = CK_TRUE;
        CK_ATTRIBUTE public_template[] = {{CKA_TOKEN, &no, 1}, {CKA_EC_PARAMS, (void *)prime256v1, sizeof prime256v1}};
        CK_ATTRIBUTE private_template[] = {{CKA_TOKEN, &no, 1}, {CKA_SIGN, &yes, 1}, {CKA_SENSITIVE, &yes, 1}, {CKA_PRIVATE, &yes, 1}};
        CK_MECHANISM generate = {CKM_EC_KEY_PAIR_GEN, NULL, 0};
        CK_OBJECT_HANDLE public_key;
        rv = p11->C_GenerateKeyPair(session, &generate, public_template, 2, private_template, 4, &public_key, &key);
        if (rv != CKR_OK) { w->failure = rv; return NULL; }
    }
    CK_MECHANISM ecdsa = {CKM_ECDSA, NULL, 0};
    unsigned char digest[32], signature[64];
    memset(digest, 0x5a, sizeof digest);
    while (!stopping) {
        CK_ULONG length = sizeof signature;
        rv = p11->C_SignInit(session, &ecdsa, key);
        if (rv == CKR_OK) rv = p11->C_Sign(session, digest, sizeof digest, signature, &length);
        if (rv != CKR_OK) { w->failure = rv; break; }
        w->signatures++;
    }
    p11->C_CloseSession(session);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 8 || (strcmp(argv[5], "token") && strcmp(argv[5], "session"))) {
        fprintf(stderr, "usage: %s MODULE TOKEN_LABEL KEY_ID PIN_FILE token|session THREADS SECONDS\n", argv[0]);
        return 64;
    }
    session_keys = strcmp(argv[5], "session") == 0;
    int threads = atoi(argv[6]), seconds = atoi(argv[7]);
    if (threads < 1 || threads > 256 || seconds < 1) { fprintf(stderr, "THREADS 1-256, SECONDS >= 1\n"); return 64; }
    char pin[256];
    FILE *pin_file = fopen(argv[4], "r");
    if (!pin_file || !fgets(pin, sizeof pin, pin_file)) { fprintf(stderr, "cannot read the PIN file\n"); return 66; }
    fclose(pin_file);
    pin[strcspn(pin, "\r\n")] = 0;

    void *module = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!module) { fprintf(stderr, "%s\n", dlerror()); return 69; }
    CK_C_GetFunctionList get_function_list = (CK_C_GetFunctionList)dlsym(module, "C_GetFunctionList");
    if (!get_function_list || get_function_list(&p11) != CKR_OK) { fprintf(stderr, "no C_GetFunctionList\n"); return 69; }
    CK_C_INITIALIZE_ARGS init = {0};
    init.flags = CKF_OS_LOCKING_OK;
    CK_RV rv = p11->C_Initialize(&init);
    if (rv != CKR_OK) { fprintf(stderr, "C_Initialize: 0x%lx\n", rv); return 69; }

    CK_SLOT_ID slots[64];
    CK_ULONG count = 64;
    rv = p11->C_GetSlotList(CK_TRUE, slots, &count);
    if (rv != CKR_OK) { fprintf(stderr, "C_GetSlotList: 0x%lx\n", rv); return 69; }
    size_t label_length = strlen(argv[2]);
    int found = 0;
    for (CK_ULONG i = 0; i < count && !found; i++) {
        CK_TOKEN_INFO info;
        if (p11->C_GetTokenInfo(slots[i], &info) != CKR_OK) continue;
        if (label_length <= 32 && memcmp(info.label, argv[2], label_length) == 0
            && (label_length == 32 || info.label[label_length] == ' ')) { slot = slots[i]; found = 1; }
    }
    if (!found) { fprintf(stderr, "no token labelled %s\n", argv[2]); return 69; }

    CK_SESSION_HANDLE login_session;
    rv = p11->C_OpenSession(slot, CKF_SERIAL_SESSION, NULL, NULL, &login_session);
    if (rv == CKR_OK) rv = p11->C_Login(login_session, CKU_USER, (CK_UTF8CHAR_PTR)pin, strlen(pin));
    memset(pin, 0, sizeof pin);
    if (rv != CKR_OK) { fprintf(stderr, "C_Login: 0x%lx (not retried)\n", rv); return 77; }
    CK_OBJECT_CLASS private_class = CKO_PRIVATE_KEY;
    CK_ATTRIBUTE query[] = {{CKA_CLASS, &private_class, sizeof private_class}, {CKA_ID, argv[3], strlen(argv[3])}};
    CK_ULONG matches = 0;
    rv = p11->C_FindObjectsInit(login_session, query, 2);
    if (rv == CKR_OK) rv = p11->C_FindObjects(login_session, &token_key, 1, &matches);
    p11->C_FindObjectsFinal(login_session);
    if (rv != CKR_OK || matches != 1) { fprintf(stderr, "no private key with CKA_ID %s\n", argv[3]); return 65; }

    struct worker *workers = calloc(threads, sizeof *workers);
    if (!workers) return 71;
    for (int i = 0; i < threads; i++) pthread_create(&workers[i].thread, NULL, sign_loop, &workers[i]);
    double start = seconds_now();
    sleep(seconds);
    stopping = 1;
    unsigned long total = 0;
    int status = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(workers[i].thread, NULL);
        total += workers[i].signatures;
        if (workers[i].failure != CKR_OK) { fprintf(stderr, "thread %d: 0x%lx\n", i, workers[i].failure); status = 70; }
    }
    printf("%s key, %d threads: %.0f signatures/s\n", argv[5], threads, total / (seconds_now() - start));
    p11->C_Logout(login_session);
    p11->C_Finalize(NULL);
    return status;
}
