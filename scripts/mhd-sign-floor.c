/*
 * The floor under signerd's request path on this machine: the same libraries
 * (libmicrohttpd, thread per connection, on a Unix socket; the PKCS#11 module;
 * libcrypto) doing only what must be done for a signature: SHA-256 over the
 * request body, C_SignInit/C_Sign (CKM_ECDSA) on one session per connection
 * thread, DER, Base64, {"signature":"..."}. No JSON parsing, no field checks,
 * no limits, no metrics: an experiment for docs/BENCHMARKS.md, not a server.
 * GET answers with the file KEYS_JSON (a saved `GET /v1/keys` of signerd),
 * which `signctl bench` reads before it starts. `scripts/bench.sh` builds and
 * runs it in every round; the lines below run it by hand.
 *
 * With signerd running on the token (CONFIG its configuration, SOCKET its
 * socket_path) and FLOOR.json a copy of CONFIG whose socket_path is
 * /tmp/floor.sock:
 *
 *   cc -O2 scripts/mhd-sign-floor.c -o /tmp/mhd-sign-floor -lmicrohttpd -lcrypto -ldl -lpthread
 *   curl -s --unix-socket SOCKET http://localhost/v1/keys > /tmp/keys.json
 *   /tmp/mhd-sign-floor /tmp/floor.sock /usr/lib/softhsm/libsofthsm2.so TOKEN_LABEL KEY_ID PIN_FILE /tmp/keys.json &
 *   signctl --config FLOOR.json bench --concurrency 8 --duration 10
 *   signctl --config CONFIG bench --concurrency 8 --duration 10
 *
 * The PIN is read from PIN_FILE, never from the command line.
 */
#include <dlfcn.h>
#include <microhttpd.h>
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <p11-kit-1/p11-kit/pkcs11.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static CK_FUNCTION_LIST_PTR p11;
static CK_SLOT_ID slot;
static const char *key_id;
static char keys_json[16384];
static size_t keys_length;
static __thread CK_SESSION_HANDLE session;
static __thread CK_OBJECT_HANDLE key;

static void fail(const char *what) { fprintf(stderr, "mhd-sign-floor: %s\n", what); exit(1); }

/* This thread's session and the private key with CKA_ID key_id in it. */
static int thread_session(void) {
  if (session) return 0;
  if (p11->C_OpenSession(slot, CKF_SERIAL_SESSION, NULL, NULL, &session) != CKR_OK) return -1;
  CK_OBJECT_CLASS class = CKO_PRIVATE_KEY;
  CK_ATTRIBUTE template[] = {{CKA_CLASS, &class, sizeof class}, {CKA_ID, (void *)key_id, strlen(key_id)}};
  CK_ULONG found = 0;
  if (p11->C_FindObjectsInit(session, template, 2) != CKR_OK) return -1;
  p11->C_FindObjects(session, &key, 1, &found);
  p11->C_FindObjectsFinal(session);
  return found == 1 ? 0 : -1;
}

/* One DER INTEGER from a 32-byte big-endian value. */
static size_t der_integer(unsigned char *out, const unsigned char *value) {
  int skip = 0;
  while (skip < 31 && value[skip] == 0) skip++;
  int pad = value[skip] & 0x80 ? 1 : 0;
  size_t o = 0;
  out[o++] = 0x02;
  out[o++] = (unsigned char)(32 - skip + pad);
  if (pad) out[o++] = 0;
  memcpy(out + o, value + skip, 32 - skip);
  return o + 32 - skip;
}

struct request { size_t length; unsigned char body[8192]; };

static enum MHD_Result answer(struct MHD_Connection *connection, unsigned status, const char *body, size_t length) {
  struct MHD_Response *response = MHD_create_response_from_buffer(length, (void *)body, MHD_RESPMEM_MUST_COPY);
  MHD_add_response_header(response, "Content-Type", "application/json");
  enum MHD_Result result = MHD_queue_response(connection, status, response);
  MHD_destroy_response(response);
  return result;
}

static enum MHD_Result handler(void *context, struct MHD_Connection *connection, const char *url, const char *method,
                               const char *version, const char *data, size_t *size, void **state) {
  (void)context; (void)url; (void)version;
  if (strcmp(method, "GET") == 0) return answer(connection, 200, keys_json, keys_length);
  struct request *request = *state;
  if (!request) { *state = calloc(1, sizeof *request); return *state ? MHD_YES : MHD_NO; }
  if (*size) {
    if (*size > sizeof request->body - request->length) return MHD_NO;
    memcpy(request->body + request->length, data, *size);
    request->length += *size;
    *size = 0;
    return MHD_YES;
  }
  unsigned char digest[32], raw[64], der[72], base64[100];
  CK_MECHANISM mechanism = {CKM_ECDSA, NULL, 0};
  SHA256(request->body, request->length, digest);
  size_t length = 0;
  /* As signerd does, a signature whose DER would be under 70 bytes (about one in 512) is made again,
     so that every answer is 70-72 DER bytes and 96 Base64 characters (apple-signatures.md). */
  while (length < 68) {
    CK_ULONG raw_length = sizeof raw;
    if (thread_session() != 0 || p11->C_SignInit(session, &mechanism, key) != CKR_OK
        || p11->C_Sign(session, digest, sizeof digest, raw, &raw_length) != CKR_OK || raw_length != 64)
      return answer(connection, 503, "{}", 2);
    length = der_integer(der + 2, raw);
    length += der_integer(der + 2 + length, raw + 32);
  }
  der[0] = 0x30;
  der[1] = (unsigned char)length;
  EVP_EncodeBlock(base64, der, (int)length + 2);
  char body[160];
  int body_length = snprintf(body, sizeof body, "{\"signature\":\"%s\"}", base64);
  return answer(connection, 200, body, (size_t)body_length);
}

static void completed(void *context, struct MHD_Connection *connection, void **state, enum MHD_RequestTerminationCode code) {
  (void)context; (void)connection; (void)code;
  free(*state);
  *state = NULL;
}

int main(int argc, char **argv) {
  if (argc != 7) fail("usage: mhd-sign-floor SOCKET MODULE TOKEN_LABEL KEY_ID PIN_FILE KEYS_JSON");
  key_id = argv[4];
  void *module = dlopen(argv[2], RTLD_NOW);
  if (!module) fail("cannot load the module");
  CK_C_GetFunctionList get_function_list = (CK_C_GetFunctionList)dlsym(module, "C_GetFunctionList");
  if (!get_function_list || get_function_list(&p11) != CKR_OK) fail("C_GetFunctionList");
  CK_C_INITIALIZE_ARGS initialize = {0};
  initialize.flags = CKF_OS_LOCKING_OK;
  if (p11->C_Initialize(&initialize) != CKR_OK) fail("C_Initialize");
  CK_SLOT_ID slots[64];
  CK_ULONG count = 64, label_length = strlen(argv[3]);
  int found = 0;
  if (p11->C_GetSlotList(CK_TRUE, slots, &count) != CKR_OK) fail("C_GetSlotList");
  for (CK_ULONG i = 0; i < count && !found; i++) {
    CK_TOKEN_INFO info;
    if (p11->C_GetTokenInfo(slots[i], &info) != CKR_OK || label_length > 32) continue;
    if (memcmp(info.label, argv[3], label_length) == 0 && (label_length == 32 || info.label[label_length] == ' ')) {
      slot = slots[i];
      found = 1;
    }
  }
  if (!found) fail("no token with that label");
  char pin[256];
  FILE *pin_file = fopen(argv[5], "r");
  if (!pin_file) fail("cannot read the PIN file");
  size_t pin_length = fread(pin, 1, sizeof pin, pin_file);
  fclose(pin_file);
  while (pin_length && (pin[pin_length - 1] == '\n' || pin[pin_length - 1] == '\r')) pin_length--;
  CK_SESSION_HANDLE login;
  if (p11->C_OpenSession(slot, CKF_SERIAL_SESSION, NULL, NULL, &login) != CKR_OK) fail("C_OpenSession");
  if (p11->C_Login(login, CKU_USER, (CK_UTF8CHAR_PTR)pin, pin_length) != CKR_OK) fail("C_Login");
  memset(pin, 0, sizeof pin);
  FILE *keys = fopen(argv[6], "r");
  if (!keys) fail("cannot read KEYS_JSON");
  keys_length = fread(keys_json, 1, sizeof keys_json, keys);
  fclose(keys);
  int listener = socket(AF_UNIX, SOCK_STREAM, 0);
  struct sockaddr_un address = {.sun_family = AF_UNIX};
  strncpy(address.sun_path, argv[1], sizeof address.sun_path - 1);
  unlink(argv[1]);
  if (bind(listener, (struct sockaddr *)&address, sizeof address) != 0 || listen(listener, 128) != 0) fail("cannot listen");
  sigset_t signals;
  int received;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, NULL);
  struct MHD_Daemon *daemon = MHD_start_daemon(
      MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL | MHD_USE_ITC, 0, NULL, NULL,
      handler, NULL, MHD_OPTION_LISTEN_SOCKET, listener, MHD_OPTION_NOTIFY_COMPLETED, completed, NULL, MHD_OPTION_END);
  if (!daemon) fail("MHD_start_daemon");
  sigwait(&signals, &received);
  MHD_stop_daemon(daemon);
  unlink(argv[1]);
  return 0;
}
